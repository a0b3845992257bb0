"""Reading the state folder's files safely: never through a link, never a FIFO or a device."""

import os
import stat
from pathlib import Path


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
