"""The download folder's locks: one discipline across threads and processes.

Every lock is a flock, held by an open file, so a process killed with -9 holds nothing:
- the folder itself (`folder_locked`), locked exclusively for each short decision about its
  contents: making room, finishing a download, dropping a file, cleaning at a start;
- a `.partial-*` file, locked exclusively by its writer while it is written: a start cleans
  only partial files (and per-adapter `.lock-*` files) that no live process holds (`drop_unheld`);
- a complete file, locked shared by everyone using it (`open_shared`, kept by the open
  `holding_downloads`): a file in use is never evicted nor deleted;
- `.lock-*`, one per adapter, locked exclusively while it is fetched (`lock_until`).
A lock taken on a file that was renamed or removed meanwhile is worth nothing: `same_file`
tells, and the taker tries again.
"""

import contextlib
import contextvars
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a wait (for another process's lock, for room in the folder) looks again

Release = Callable[[int], None]  # closes a user's open file (and drops the file if it was deleted meanwhile)


class _Holds:
    """The files one request uses, each an open file locked shared, released together."""

    def __init__(self):
        self._files: list[tuple[int, Release]] = []
        self._lock = threading.Lock()
        self._closed = False

    def add(self, fd: int, release: Release) -> None:
        with self._lock:
            if not self._closed:
                self._files.append((fd, release))
                return
        release(fd)  # a thread that found it after the request ended

    def release_all(self) -> None:
        with self._lock:
            self._closed, files, self._files = True, self._files, []
        for fd, release in files:
            release(fd)

    def total_bytes(self) -> int:
        """The bytes of the distinct files held (a file found twice counts once)."""
        with self._lock:
            stats = [os.fstat(fd) for fd, _ in self._files]
        return sum({(st.st_dev, st.st_ino): st.st_size for st in stats}.values())


_holds: contextvars.ContextVar[_Holds | None] = contextvars.ContextVar("loraswap_download_holds", default=None)


@contextlib.contextmanager
def holding_downloads() -> Iterator[None]:
    """While inside, every download found or fetched (here, or in a thread run with this
    context) is in use: never evicted nor deleted until the outermost one exits."""
    if _holds.get() is not None:
        yield
        return
    holds = _Holds()
    token = _holds.set(holds)
    try:
        yield
    finally:
        _holds.reset(token)
        holds.release_all()


@contextlib.asynccontextmanager
async def holding_downloads_in_coroutine() -> AsyncIterator[None]:
    """`holding_downloads` for a coroutine: the files are released on a worker thread, since
    releasing one may stat it, wait for the folder's lock and unlink it, no work for an event loop."""
    if _holds.get() is not None:
        yield
        return
    holds = _Holds()
    token = _holds.set(holds)
    try:
        yield
    finally:
        _holds.reset(token)
        await anyio.to_thread.run_sync(holds.release_all)  # not abandoned if cancelled: every file is released


def hold(fd: int, release: Release) -> None:
    """Keep `fd` (a file locked shared) until the open `holding_downloads` exits, then
    `release(fd)`; with none open, `release(fd)` now."""
    holds = _holds.get()
    if holds is None:
        release(fd)
    else:
        holds.add(fd, release)


def held_bytes() -> int:
    """The bytes of the downloads the open `holding_downloads` holds (0 with none open)."""
    holds = _holds.get()
    return 0 if holds is None else holds.total_bytes()


@contextlib.contextmanager
def folder_locked(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)  # an open of its own: flock excludes the process's other threads too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_shared(file: Path) -> int | None:
    """`file` opened and locked shared (a use), or None if it is gone or was just replaced."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while the folder's lock holder drops or renames it
    if same_file(file, fd):
        return fd
    os.close(fd)
    return None


def drop_unheld(file: Path, *also: Path) -> bool:
    """Under the folder's lock: remove `file` (and `also`) unless a live process holds it;
    whether it is gone."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        for path in (*also, file):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
    logger.info("download cache: dropped %s", file.name)
    return True


def drop_if_last(fd: int, file: Path) -> None:
    """Under the folder's lock: remove `file`, held by `fd`, if no one else holds it."""
    with contextlib.suppress(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        file.unlink(missing_ok=True)
        logger.info("download cache: dropped %s, deleted while in use", file.name)


def same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def lock_until(fd: int, deadline: float) -> bool:
    """Lock `fd` exclusively, waiting until `deadline` at most; whether it is locked."""
    if deadline == math.inf:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
