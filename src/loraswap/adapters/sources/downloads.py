"""Adapter files fetched from elsewhere (a URL, Civitai, a bucket), kept on disk.

One folder (`--download-dir`), which several processes may share (the ranks of one image,
replicas or servers on one machine). Each file is named by the sha256 of its adapter id,
beside a small JSON record of what it is (id, source, where it came from with no query
string, size, sha256). A file is written under a temporary name (`.partial-*`) and renamed
once it is complete and checked, so a partial file is never served. The files and their
records survive a restart: an adapter fetched once is served by its id until it is dropped.

One lock discipline across threads and processes (`download_locks.py`): one fetch at a time
per adapter, and in one process the requests waiting for it share its outcome, a failure
included (on the server's fetch pool they wait without a thread: `download_waits.py`); a file
in use (`holding_downloads`) is never evicted nor deleted, and one deleted meanwhile
(`remove`) goes when its last user releases it; a start cleans only what no live process holds.

The budget (`--download-cache-gb`) is a bound: a download reserves its size before its
body is written (its partial file grows to it, sparse), and the least recently used files
no one holds make room. While there is none, a request holding no download waits until its
deadline; one that already holds some fails at once (two such requests would wait on each
other), with a 400 when its own files and this one cannot fit the budget together.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

from loraswap.adapters.sources.download_locks import (
    POLL_S,
    drop_if_last,
    drop_unheld,
    folder_locked,
    held_bytes,
    hold,
    lock_until,
    open_shared,
    same_file,
)
from loraswap.adapters.sources.download_waits import FetchInFlight, fresh_failure, waits_handed_back
from loraswap.errors import AdapterInvalid, AdapterUnavailable, Overloaded
from loraswap.paths import user_cache

logger = logging.getLogger(__name__)

PARTIAL_PREFIX = ".partial-"
LOCK_PREFIX = ".lock-"
FOLLOW_GRACE_S = 1.0  # how long past its deadline a request waits for the fetch it shares

# reserve(bytes the file will have, bytes more it may well have), before they are written
Reserve = Callable[[int, int], None]
Fetch = Callable[[Path, Reserve], "Download"]  # writes the temporary path, reserving as it learns the size


@dataclass(frozen=True)
class Download:
    """What a fetch gives the cache to record beside the file it wrote."""

    source: str  # url, civitai, s3
    shown: str  # where it came from, as logs and listings may show it (no query string, no token)
    sha256: str  # of the bytes written
    base_model: str | None = None  # what the source says the adapter is for (Civitai's baseModel)
    origin: str | None = None  # the API or store it came through (Civitai's API base, the S3 endpoint)


def default_download_dir() -> Path:
    return user_cache("downloads")


class DownloadCache:
    def __init__(self, folder: Path, max_bytes: int):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._flights: dict[str, Future] = {}  # adapter id -> the fetch in flight in this process
        self._flights_lock = threading.Lock()
        with folder_locked(self.folder):
            self._clean()

    # ---------------------------------------------------------------- reading
    def path(self, adapter_id: str, accept: Callable[[dict], bool] | None = None) -> Path | None:
        """The adapter's complete file, marked as just used and held by the open
        `holding_downloads`; None if it is not here (or `accept(its record)` is false)."""
        record = self.record(adapter_id)
        if record is None or (accept is not None and not accept(record)):
            return None
        file = self._file(adapter_id)
        fd = open_shared(file)
        if fd is None:
            return None
        # the record is marked, not the file: the file's own times are its stamp in the adapter
        # cache, which a new mtime would make read it again on every use
        with contextlib.suppress(OSError):
            os.utime(self._record_path(adapter_id))
        hold(fd, lambda fd: self._release(fd, file))
        return file

    def has(self, adapter_id: str) -> bool:
        """Whether the adapter is here, complete (without holding it)."""
        return self._record_path(adapter_id).is_file() and self._file(adapter_id).is_file()

    def record(self, adapter_id: str) -> dict | None:
        try:
            return json.loads(self._record_path(adapter_id).read_text())
        except (OSError, ValueError):
            return None

    def records(self) -> list[dict]:
        """Every complete download's record, with its size (for `GET /adapters`)."""
        rows = []
        for record_path in sorted(self.folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(record_path.read_text())
                if self._file(record["id"]).is_file():
                    rows.append(record)
        return rows

    # ---------------------------------------------------------------- fetching
    def fetch(self, adapter_id: str, fetch: Fetch, deadline: float = math.inf,
              accept: Callable[[dict], bool] | None = None) -> Path:
        """The adapter's file (held, as `path`): from here, else `fetch(temporary path, reserve)`
        writes it, once however many threads and processes ask at the same time; those waiting
        in this process share its outcome (or, on the fetch pool, are handed the wait:
        `FetchInFlight`). A failed fetch leaves nothing behind. Waits (for room, for another
        process's fetch) end at `deadline` (a `time.monotonic()` instant)."""
        while True:
            found = self.path(adapter_id, accept)
            if found is not None:
                return found
            with self._flights_lock:
                flight = self._flights.get(adapter_id)
                leading = flight is None
                if leading:
                    flight = self._flights[adapter_id] = Future()
            if leading:
                return self._lead(adapter_id, flight, fetch, deadline, accept)
            if waits_handed_back():
                raise FetchInFlight(adapter_id, flight)
            follow(adapter_id, flight, deadline)  # fetched: taken from here (held) on the next turn

    def _lead(self, adapter_id: str, flight: Future, fetch: Fetch, deadline: float,
              accept: Callable[[dict], bool] | None) -> Path:
        try:
            with self._fetching(adapter_id, deadline):
                found = self.path(adapter_id, accept)  # another process fetched it meanwhile
                found = found if found is not None else self._fetch_now(adapter_id, fetch, deadline)
        except BaseException as e:
            flight.set_exception(e)
            raise
        finally:
            with self._flights_lock:
                del self._flights[adapter_id]
        flight.set_result(None)
        return found

    @contextlib.contextmanager
    def _fetching(self, adapter_id: str, deadline: float) -> Iterator[None]:
        """Held while the adapter is looked for and fetched, by one thread of any process using
        this folder. The lock file is removed by its holder; a waiter that then holds a removed
        one tries again."""
        path = self.folder / f"{LOCK_PREFIX}{_name(adapter_id)}"
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            locked = lock_until(fd, deadline)
            if locked and same_file(path, fd):
                break
            os.close(fd)
            if not locked:
                raise AdapterUnavailable(adapter_id, "another process sharing the download folder is still "
                                         "fetching it", "Try again later")
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)

    def _fetch_now(self, adapter_id: str, fetch: Fetch, deadline: float) -> Path:
        with folder_locked(self.folder):  # made and locked at once: a start never takes it for a dead one's
            partial = self.folder / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
            fd = os.open(partial, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        reservation = _Reservation(lambda total, ahead: self._reserve(adapter_id, partial, total, deadline, ahead))
        try:
            download = fetch(partial, reservation.reserve)
            size = os.fstat(fd).st_size
            reservation.reserve(size)  # all it wrote, if it reserved less
            file = self._finish(adapter_id, partial, fd, download, size)
        except BaseException:
            partial.unlink(missing_ok=True)
            os.close(fd)
            raise
        hold(fd, lambda fd: self._release(fd, file))
        logger.info("downloaded %s (%s, %.1f MiB)", adapter_id, download.shown, size / 2**20)
        return file

    def _finish(self, adapter_id: str, partial: Path, fd: int, download: Download, size: int) -> Path:
        """Record it and rename it into place, its writer's lock turned into a user's."""
        record = {"id": adapter_id, "source": download.source, "shown": download.shown, "bytes": size,
                  "sha256": download.sha256, "base_model": download.base_model, "origin": download.origin}
        file = self._file(adapter_id)
        with folder_locked(self.folder):  # no one drops it between the rename and the shared lock
            self._write_record(adapter_id, record)
            os.replace(partial, file)  # complete and checked: now it may be served
            fcntl.flock(fd, fcntl.LOCK_SH)
        return file

    def _write_record(self, adapter_id: str, record: dict) -> None:
        partial = self.folder / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
        partial.write_text(json.dumps(record))
        os.replace(partial, self._record_path(adapter_id))

    # ---------------------------------------------------------------- room
    def _reserve(self, adapter_id: str, partial: Path, total: int, deadline: float, ahead: int = 0) -> int:
        """Make the partial file `total` bytes long (sparse; `ahead` more where the budget allows,
        so that a body of unknown length reserves seldom), once that fits the budget with every
        other file and reservation; wait for room until `deadline`, unless the caller already
        holds downloads: then no room is a 503 at once. The bytes reserved."""
        own = held_bytes()  # this request's other downloads: in use, so never dropped to make room
        self._check_budget(adapter_id, total, own)
        total = min(total + ahead, self.max_bytes)
        while True:
            with folder_locked(self.folder):
                if self._make_room(partial, total):
                    if partial.stat().st_size < total:
                        os.truncate(partial, total)
                    return total
            if own:  # waiting while holding could wait on a request that waits for these
                raise Overloaded(f"adapter '{adapter_id}': the download folder is full of adapters in use, some by "
                                 f"this request ({self.max_bytes} bytes, --download-cache-gb); retry later")
            if time.monotonic() >= deadline:
                raise Overloaded(f"adapter '{adapter_id}': the download folder is full of adapters in use "
                                 f"({self.max_bytes} bytes, --download-cache-gb); retry later")
            time.sleep(POLL_S)

    def _check_budget(self, adapter_id: str, total: int, own: int) -> None:
        """400 for a file that cannot fit the budget, alone or with the caller's other downloads."""
        if total > self.max_bytes:
            raise AdapterInvalid(adapter_id, f"it is over {total} bytes, more than the download folder may hold "
                                 f"({self.max_bytes} bytes)", "Start the server with a larger --download-cache-gb")
        if own + total > self.max_bytes:
            raise AdapterInvalid(adapter_id, f"it is over {total} bytes, and with the {own} bytes of the other "
                                 f"downloads this request uses, more than the download folder may hold "
                                 f"({self.max_bytes} bytes)", "Name fewer or smaller adapters from elsewhere in one "
                                 "request, or start the server with a larger --download-cache-gb")

    def _make_room(self, partial: Path, total: int) -> bool:
        """Under the folder's lock: whether `total` bytes for `partial` fit, once files no one
        holds are dropped, a dead process's partial files first, then the least recently used."""
        files = [f for f in self.folder.iterdir() if f != partial and
                 (f.suffix == ".safetensors" or f.name.startswith(PARTIAL_PREFIX))]
        sizes = {f: _size(f) for f in files}
        used = sum(sizes.values()) + total
        partials = [f for f in files if f.name.startswith(PARTIAL_PREFIX)]
        complete = sorted((f for f in files if f.suffix == ".safetensors"), key=_last_used)
        for file in partials + complete:
            if used <= self.max_bytes:
                break
            if drop_unheld(file, *self._record_of(file)):
                used -= sizes[file]
        return used <= self.max_bytes

    def remove(self, adapter_id: str) -> bool:
        """Drop the adapter's record and file (a file in use goes when its last user lets go);
        whether there was one."""
        file = self._file(adapter_id)
        had = file.is_file()
        with folder_locked(self.folder):
            self._record_path(adapter_id).unlink(missing_ok=True)
            drop_unheld(file)
        return had

    def used_bytes(self) -> int:
        """The files' and the reservations' bytes."""
        return sum(_size(f) for f in self.folder.iterdir() if f.suffix == ".safetensors" or
                   f.name.startswith(PARTIAL_PREFIX))

    @staticmethod
    def _record_of(file: Path) -> tuple[Path, ...]:
        """A complete file's record, dropped with it."""
        return (file.with_suffix(".json"),) if file.suffix == ".safetensors" else ()

    def _clean(self) -> None:
        """Under the folder's lock, at start: what no live process holds of what a crash left
        (partial files, lock files, files whose record is gone), and records whose file is gone."""
        for file in self.folder.iterdir():
            orphan = file.suffix == ".safetensors" and not file.with_suffix(".json").is_file()
            if orphan or file.name.startswith((PARTIAL_PREFIX, LOCK_PREFIX)):
                drop_unheld(file)
            elif file.suffix == ".json" and not file.with_suffix(".safetensors").is_file():
                file.unlink(missing_ok=True)

    def _release(self, fd: int, file: Path) -> None:
        """Close a user's lock; a file deleted while in use (its record gone) goes with its last user."""
        try:
            if not file.with_suffix(".json").exists() and same_file(file, fd):
                with folder_locked(self.folder):
                    if not file.with_suffix(".json").exists() and same_file(file, fd):
                        drop_if_last(fd, file)
        finally:
            os.close(fd)

    def _file(self, adapter_id: str) -> Path:
        return self.folder / f"{_name(adapter_id)}.safetensors"

    def _record_path(self, adapter_id: str) -> Path:
        return self.folder / f"{_name(adapter_id)}.json"


class _Reservation:
    """The room one fetch has reserved in the folder so far, grown as it learns the size.
    `make_room(total, ahead)`: `DownloadCache._reserve` for its partial file; the bytes reserved."""

    def __init__(self, make_room: Callable[[int, int], int]):
        self._make_room = make_room
        self.bytes = 0

    def reserve(self, total: int, ahead: int = 0) -> None:
        """`Reserve`: room for `total` bytes (and `ahead` more where the budget allows)."""
        if total > self.bytes:
            self.bytes = self._make_room(total, ahead)


def follow(adapter_id: str, flight: Future, deadline: float) -> None:
    """Wait in this thread for another request's fetch of the adapter, until `deadline` and a
    moment (the fetch ends by its own deadline, set a moment before or after this request's);
    its failure is this request's too."""
    if not wait([flight], deadline + FOLLOW_GRACE_S - time.monotonic() if deadline < math.inf else None).done:
        raise AdapterUnavailable(adapter_id, "it is still being fetched for another request", "Try again later")
    failure = flight.exception()
    if failure is not None:
        raise fresh_failure(failure) from failure


def _name(adapter_id: str) -> str:
    return hashlib.sha256(adapter_id.encode()).hexdigest()[:32]


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        return 0


def _last_used(file: Path) -> float:
    """When the download was last used (`path` marks its record); a file without a record
    counts as the oldest."""
    try:
        return file.with_suffix(".json").stat().st_mtime
    except OSError:
        return 0.0
