"""The digests of a safetensors file taken the plain way, from all of its bytes at once: the
reference that the digests taken as a file is read (`adapters/files/hashes.py:ReadDigest`)
are compared against."""

import hashlib
from pathlib import Path

from loraswap.adapters.files.hashes import FileDigest


def hash_file(path: Path) -> FileDigest:
    """Both digests of the file at `path`: of all of it, and of the bytes after its header
    (kohya's hash, as A1111's `addnet_hash_safetensors` takes it)."""
    data = Path(path).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    return FileDigest(hashlib.sha256(data).hexdigest(), hashlib.sha256(data[header_end:]).hexdigest())
