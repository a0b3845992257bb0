"""Reading and writing the state folder's files safely: never through a link, never a FIFO or a
device; a file written is visible only once whole."""

import os
import stat
from pathlib import Path

PART = ".part"  # the suffix of a file being written (`write_whole`)


def plain_file(path: Path) -> bool:
    """A regular file, not a link."""
    return not path.is_symlink() and path.is_file()


def read_plain_file(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file, never read through a link (OSError), nor a FIFO or a device
    that could block; ValueError past `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path.name} is over {limit} bytes")
    return data


def write_whole(path: Path, write, sync: bool = True) -> None:
    """`write(file)` into `path` under a temporary name (never through a link), renamed once
    complete (and, with `sync`, on disk): how the video jobs' files, the owner secret and the
    record of kept adapters are written. (Kept images have a writer of their own,
    `images/kept.py`: a new file only, readable by this user alone, with the time it expires from.)"""
    part = path.with_name(path.name + PART)
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
