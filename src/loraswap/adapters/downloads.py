"""Adapter files fetched from elsewhere (a URL, Civitai, a bucket), kept on disk.

One folder (`--download-dir`), least recently used files dropped past a byte budget
(`--download-cache-gb`). Each file is named by the sha256 of its adapter id, beside a
small JSON record of what it is (id, source, where it came from with no query string,
size, sha256). A file is written under a temporary name and renamed once it is complete
and checked, so a partial file is never served; a crash leaves only temporary files,
removed at the next start. One fetch at a time per adapter, however many requests (and
processes sharing the folder) wait for it. The files and their records survive a restart:
an adapter fetched once is served by its id from here until it is dropped.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..paths import user_cache

logger = logging.getLogger(__name__)

PARTIAL_PREFIX = ".partial-"
LOCK_PREFIX = ".lock-"


@dataclass(frozen=True)
class Download:
    """What a fetch gives the cache to record beside the file it wrote."""

    source: str  # url, civitai, s3
    shown: str  # where it came from, as logs and listings may show it (no query string, no token)
    sha256: str  # of the bytes written
    base_model: str | None = None  # what the source says the adapter is for (Civitai's baseModel)


def default_download_dir() -> Path:
    return user_cache("downloads")


class DownloadCache:
    def __init__(self, folder: Path, max_bytes: int):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._drop_partial_files()

    # ---------------------------------------------------------------- reading
    def path(self, adapter_id: str) -> Path | None:
        """The adapter's complete file, marked as just used; None if it is not here."""
        file, record = self._file(adapter_id), self._record_path(adapter_id)
        if not file.is_file() or not record.is_file():
            return None
        with contextlib.suppress(OSError):  # dropped meanwhile: the caller fetches it again
            # the record is marked, not the file: the file's own times are its stamp in the adapter
            # cache, which a new mtime would make read it again on every use
            os.utime(record)
            return file
        return None

    def record(self, adapter_id: str) -> dict | None:
        try:
            return json.loads(self._record_path(adapter_id).read_text())
        except (OSError, ValueError):
            return None

    def records(self) -> list[dict]:
        """Every complete download's record, with its size (for `GET /adapters`)."""
        rows = []
        for record_path in sorted(self.folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(record_path.read_text())
                if self._file(record["id"]).is_file():
                    rows.append(record)
        return rows

    # ---------------------------------------------------------------- fetching
    def fetch(self, adapter_id: str, fetch: Callable[[Path], Download]) -> Path:
        """The adapter's file: from here, else `fetch(temporary path)` writes it, once, however
        many threads ask at the same time; a failed fetch leaves nothing behind."""
        with self._fetching(adapter_id):
            found = self.path(adapter_id)
            if found is not None:
                return found
            return self._fetch_now(adapter_id, fetch)

    @contextlib.contextmanager
    def _fetching(self, adapter_id: str) -> Iterator[None]:
        """Held while the adapter is looked for and fetched, by one thread of any process using
        this folder (the ranks of one image, replicas on one machine): the others then find the
        file it wrote rather than fetch, and write, a copy of their own. The lock file is
        removed by its holder; a waiter that then holds a removed one tries again."""
        path = self.folder / f"{LOCK_PREFIX}{_name(adapter_id)}"
        while True:
            lock = open(path, "a")  # noqa: SIM115 - closed below, which releases the lock
            fcntl.flock(lock, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                    break
            lock.close()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
            lock.close()

    def _fetch_now(self, adapter_id: str, fetch: Callable[[Path], Download]) -> Path:
        partial = self.folder / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
        try:
            download = fetch(partial)
            size = partial.stat().st_size
            self._make_room(size, keep=adapter_id)
            file = self._file(adapter_id)
            os.replace(partial, file)  # complete and checked: now it may be served
        finally:
            partial.unlink(missing_ok=True)
        record = {"id": adapter_id, "source": download.source, "shown": download.shown, "bytes": size,
                  "sha256": download.sha256, "base_model": download.base_model}
        self._write_record(adapter_id, record)
        logger.info("downloaded %s (%s, %.1f MiB)", adapter_id, download.shown, size / 2**20)
        return file

    def _write_record(self, adapter_id: str, record: dict) -> None:
        partial = self.folder / f"{PARTIAL_PREFIX}{uuid.uuid4().hex}"
        partial.write_text(json.dumps(record))
        os.replace(partial, self._record_path(adapter_id))

    # ---------------------------------------------------------------- room
    def remove(self, adapter_id: str) -> bool:
        """Drop the adapter's file and record; whether there was one."""
        had = self._file(adapter_id).is_file()
        self._record_path(adapter_id).unlink(missing_ok=True)
        self._file(adapter_id).unlink(missing_ok=True)
        return had

    def used_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.folder.glob("*.safetensors") if f.is_file())

    def _make_room(self, incoming: int, keep: str) -> None:
        """Drop the least recently used files (their records' times) until `incoming` more bytes
        fit the budget."""
        files = sorted((f for f in self.folder.glob("*.safetensors") if f.is_file() and f != self._file(keep)),
                       key=_last_used)
        used = sum(f.stat().st_size for f in files)
        for file in files:
            if used + incoming <= self.max_bytes:
                break
            used -= file.stat().st_size
            file.with_suffix(".json").unlink(missing_ok=True)
            file.unlink(missing_ok=True)
            logger.info("download cache: dropped %s to make room", file.name)

    def _drop_partial_files(self) -> None:
        """What a crash left mid-write: never served, removed at start."""
        for partial in self.folder.glob(f"{PARTIAL_PREFIX}*"):
            partial.unlink(missing_ok=True)
        for record in self.folder.glob("*.json"):  # a record whose file is gone
            if not record.with_suffix(".safetensors").is_file():
                record.unlink(missing_ok=True)

    def _file(self, adapter_id: str) -> Path:
        return self.folder / f"{_name(adapter_id)}.safetensors"

    def _record_path(self, adapter_id: str) -> Path:
        return self.folder / f"{_name(adapter_id)}.json"


def _name(adapter_id: str) -> str:
    return hashlib.sha256(adapter_id.encode()).hexdigest()[:32]


def _last_used(file: Path) -> float:
    """When the download was last used (`path` marks its record); a file without a record
    (an old one's, half replaced) counts as the oldest."""
    try:
        return file.with_suffix(".json").stat().st_mtime
    except OSError:
        return 0.0
