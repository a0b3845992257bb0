"""The SHA-256 of adapter files, for the record each generated image carries.

The store hashes a file when it reads it (`AdapterStore._hold`, on a cache miss, alongside
the read), keeps the digest with the cache entry, and the engine reports it with what ran
(`engine.calls.AdapterRan`): a record never locates, downloads nor reads a file again.
"""

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from loraswap.adapters.sources.local import AdapterLocation, file_stamp

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    sha256: str  # of the whole file: what Civitai and the hub list as its SHA256
    tensors_sha256: str  # of the bytes after the safetensors header: kohya's hash, which A1111 shortens


def hash_file(path: Path) -> FileDigest:
    """Both digests of a safetensors file, in one read of bounded chunks (the header's length,
    read from the file, is held to the file's size: a hostile one asks for no large read)."""
    whole, tensors = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as file:
        head = file.read(8)
        whole.update(head)
        header_left = min(int.from_bytes(head, "little"), os.fstat(file.fileno()).st_size) if len(head) == 8 else 0
        while header_left > 0 and (chunk := file.read(min(CHUNK_BYTES, header_left))):
            whole.update(chunk)
            header_left -= len(chunk)
        while chunk := file.read(CHUNK_BYTES):
            whole.update(chunk)
            tensors.update(chunk)
    return FileDigest(whole.hexdigest(), tensors.hexdigest())


def hash_version(location: AdapterLocation, stamp: tuple) -> FileDigest | None:
    """The digests of the adapter's file as it was when stamped `stamp`; None when it is gone,
    unreadable, or another file by now (the record then says the hashes are not known)."""
    try:
        if file_stamp(location) != stamp:
            return None
        digest = hash_file(location.weights)
        return digest if file_stamp(location) == stamp else None  # not rewritten while it was read
    except Exception as e:  # a record is best-effort: it never fails the read of the adapter
        logger.warning("adapter %s: its file could not be hashed for the images' records: %s",
                       location.adapter_id, e)
        return None
