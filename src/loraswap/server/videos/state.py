"""Video jobs on disk, so that a restart (a deploy, the OOM killer, a lost node) loses none.

The state folder (`--state-dir`, default ~/.cache/loraswap/state):

    lock                  held (flock) by the one server using the folder
    videos.sqlite3        one row a job (SQLite, WAL mode), with -wal and -shm beside it;
                          and a row a webhook owed (`webhooks.Delivery`), until delivered
    owner-secret          the key of the digests naming the API key that made each job,
    owner-secret.copy     and its copy, from which a damaged one is written again
    videos/ID.json        the job's row again (its record), from which a lost row is rebuilt
    videos/ID.mp4         a completed job's MP4
    videos/ID.png         its first frame, lossless (the route sends it as WebP)
    videos/ID.*.part      a file being written: renamed to its name once whole
    orphans/              files found at a start that belong to no job, kept for a look

One writer: every database call takes one lock, and only the server holding the folder's
`lock` writes there. A file is visible under its name only once whole, so a crash leaves
at most a `.part` file, removed at the next start. A folder that cannot be used (another
server holds it, it cannot be created, one of its own entries is a link) never stops a
start: the jobs then live in a temporary folder, lost at a restart, and the log says so. A
database that cannot be read (truncated, garbage, another program's) is moved aside
(`videos.sqlite3.corrupt-TIME`) and a fresh one made; the jobs are then rebuilt from their
records. Ids are checked (`is_video_id`) before they name a file; no file or folder here is
reached through a link.
"""

import fcntl
import json
import logging
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from PIL import Image

from loraswap.paths import user_cache
from loraswap.server.kept_adapters import RECORD as KEPT_ADAPTERS
from loraswap.server.state_files import PART, plain_file, read_plain_file, write_whole
from loraswap.server.videos.ids import is_video_id

logger = logging.getLogger("loraswap.server")

DATABASE = "videos.sqlite3"
FILES = "videos"
ORPHANS = "orphans"
MEDIA = (".mp4", ".png")  # a completed job's video and first frame
RECORD = ".json"  # every job's record
MAX_RECORD_BYTES = 2**20  # a record holds a request: a few KiB
# what a failed write raises: the disk (full, gone, read-only) or the database on it
WRITE_ERRORS = (OSError, sqlite3.Error)
COLUMNS = ("id", "request", "model", "target", "fps", "created_at", "finished_at", "expires_at", "error",
           "seconds", "size", "attempts", "owner", "urls", "step", "total_steps", "webhook_url")
# columns a database made by an earlier version lacks: added when it is opened
ADDED_COLUMNS = ("owner", "urls", "step", "total_steps", "webhook_url")
DELIVERY_COLUMNS = ("id", "video_id", "url", "payload", "attempts", "next_at", "owner")
OWNER_SECRET = "owner-secret"  # the key of the digests that say which API key made a job
OWNER_SECRET_COPY = "owner-secret.copy"
SECRET_BYTES = 32
# the folder's own entries: a link among them is refused, never followed
OWN_ENTRIES = ("lock", FILES, ORPHANS, DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", OWNER_SECRET,
               OWNER_SECRET_COPY, KEPT_ADAPTERS)
SCHEMA = f"CREATE TABLE IF NOT EXISTS videos ({', '.join(COLUMNS)}, PRIMARY KEY (id))"
DELIVERY_SCHEMA = f"CREATE TABLE IF NOT EXISTS webhooks ({', '.join(DELIVERY_COLUMNS)}, PRIMARY KEY (id))"
class StateFolderTaken(OSError):
    """The state folder is another running server's (it holds the folder's lock)."""


def default_state_dir() -> Path:
    return user_cache("state")


class VideoState:
    """The rows and files of the video jobs in one state folder. A row is a dict of `COLUMNS`
    (`videos.VideoJob.row`), its values numbers, text or None."""

    def __init__(self, folder: Path | None):
        self.temporary = False
        self._lock = threading.Lock()
        self._lock_file = None
        try:
            self._open(Path(folder or default_state_dir()))
        except WRITE_ERRORS as e:  # another server's, or unusable: this server's jobs then die with it
            if self._lock_file is not None:
                self._lock_file.close()
            self._open(Path(tempfile.mkdtemp(prefix="loraswap-state-")))
            self.temporary = True
            if isinstance(e, StateFolderTaken):  # two servers on one machine: this one serves on, a warning
                logger.warning("%s: this one keeps its video jobs in %s, lost at a restart; give each server its "
                               "own --state-dir", e, self.folder)
            else:
                logger.error("video jobs are kept in %s and lost at a restart: %s", self.folder, e)

    def _open(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        _refuse_links(folder)
        self.folder = self._claim(folder)
        self.files = self.folder / FILES
        self.files.mkdir(exist_ok=True)
        self.owner_secret = _owner_secret(self.folder)
        self._db = self._open_database()

    def _claim(self, folder: Path) -> Path:
        """The folder, locked for this server; OSError if another server holds it."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
        lock_file = os.fdopen(os.open(folder / "lock", flags, 0o644), "a")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise StateFolderTaken(f"{folder} is the state folder of another loraswap server") from None
        self._lock_file = lock_file
        return folder

    def _open_database(self) -> sqlite3.Connection:
        path = self.folder / DATABASE
        try:
            return _connect(path)
        except sqlite3.DatabaseError as e:  # truncated or not ours: keep it for a look, start afresh
            aside = path.with_name(f"{DATABASE}.corrupt-{int(time.time())}")
            logger.error("the video jobs database %s cannot be read (%s): moved to %s, starting with none; the "
                         "jobs are rebuilt from their records in %s", path, e, aside.name, self.files)
            for suffix in ("", "-wal", "-shm"):
                if os.path.lexists(f"{path}{suffix}"):
                    os.replace(f"{path}{suffix}", f"{aside}{suffix}")
            return _connect(path)

    # ---------------------------------------------------------------- rows
    def rows(self) -> list[dict]:
        """Every job, oldest first."""
        with self._lock:
            found = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos ORDER BY created_at").fetchall()
        return [dict(zip(COLUMNS, values)) for values in found]

    def save(self, row: dict, delivery: dict | None = None) -> None:
        """Insert or replace the job's row, and write it as the job's record beside its files,
        from which the row is rebuilt when the database loses it. Both are tried; the first
        failure is raised. The record is renamed into place whole but not forced to disk: as
        the database's commits (synchronous=NORMAL), it survives a crash of the process. With
        `delivery` (the webhook its end owes), its row too, in the job's transaction."""
        try:
            data = json.dumps(row).encode()
            write_whole(self.record_path(row["id"]), lambda f: _write_private(f, data), sync=False)
        finally:
            with self._lock, self._db:
                self._db.execute(f"INSERT OR REPLACE INTO videos ({', '.join(COLUMNS)}) "
                                 f"VALUES ({', '.join('?' * len(COLUMNS))})", [row[column] for column in COLUMNS])
                if delivery is not None:
                    self._insert_delivery(delivery)

    # ---------------------------------------------------------------- webhooks owed
    def deliveries(self) -> list[dict]:
        """Every webhook owed, the oldest due first."""
        with self._lock:
            found = self._db.execute(f"SELECT {', '.join(DELIVERY_COLUMNS)} FROM webhooks ORDER BY next_at").fetchall()
        return [dict(zip(DELIVERY_COLUMNS, values)) for values in found]

    def save_delivery(self, delivery: dict) -> None:
        with self._lock, self._db:
            self._insert_delivery(delivery)

    def _insert_delivery(self, delivery: dict) -> None:
        self._db.execute(f"INSERT OR REPLACE INTO webhooks ({', '.join(DELIVERY_COLUMNS)}) VALUES "
                         f"({', '.join('?' * len(DELIVERY_COLUMNS))})", [delivery[c] for c in DELIVERY_COLUMNS])

    def remove_delivery(self, delivery_id: object) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM webhooks WHERE id = ?", (delivery_id,))

    def remove(self, video_id: str) -> None:
        """The job's files, then its row: a crash between leaves a row whose MP4 is missing,
        which the next start marks failed."""
        self.remove_files(video_id)
        self.remove_row(video_id)

    def remove_row(self, row_id: object) -> None:
        """The row of this id (whatever its type: a row that cannot be read is removed too)."""
        with self._lock, self._db:
            self._db.execute("DELETE FROM videos WHERE id = ?", (row_id,))

    # ---------------------------------------------------------------- files
    def mp4_path(self, video_id: str) -> Path:
        return self._path(video_id, ".mp4")

    def thumbnail_path(self, video_id: str) -> Path:
        return self._path(video_id, ".png")

    def record_path(self, video_id: str) -> Path:
        return self._path(video_id, RECORD)

    def _path(self, video_id: str, suffix: str) -> Path:
        if not is_video_id(video_id):
            raise ValueError(f"{str(video_id)[:80]!r} is not a video id")
        return self.files / f"{video_id}{suffix}"

    def write_files(self, video_id: str, mp4: bytes, thumbnail: Image.Image) -> None:
        """The MP4 and the first frame, each visible only once whole; on a failure neither is
        left. Blocking: run it off the event loop."""
        try:
            write_whole(self.thumbnail_path(video_id), lambda f: thumbnail.save(f, format="PNG"))
            write_whole(self.mp4_path(video_id), lambda f: f.write(mp4))
        except BaseException:
            self.remove_files(video_id, MEDIA)
            raise

    def remove_files(self, video_id: str, suffixes: tuple[str, ...] = (*MEDIA, RECORD)) -> None:
        """The job's files of these suffixes, and their `.part` files: each named, never globbed."""
        for suffix in suffixes:
            path = self._path(video_id, suffix)
            path.unlink(missing_ok=True)
            path.with_name(path.name + PART).unlink(missing_ok=True)

    def read_record(self, video_id: str) -> object:
        """The job's record as written (a row, unless damaged); OSError or ValueError if unreadable."""
        return json.loads(read_plain_file(self.record_path(video_id), MAX_RECORD_BYTES))

    def record_ids(self) -> set[str]:
        """The ids of the jobs that have a record."""
        return {path.name.removesuffix(RECORD) for path in self.files.iterdir()
                if path.name.endswith(RECORD) and is_video_id(path.name.removesuffix(RECORD)) and plain_file(path)}

    def sort_out_at_start(self, completed: set[str], known: set[str]) -> tuple[list[str], list[str]]:
        """At a start, nothing being written: the `.part` files a crash left are removed, and the
        MP4 and frame of a job not completed (it is made again, or failed); anything else not a
        `known` job's is moved to `orphans/`, never deleted (a database that lost rows must not
        cost their videos). The names (removed, moved)."""
        removed, moved = [], []
        for path in sorted(self.files.iterdir()):
            video_id, dot, suffix = path.name.partition(".")
            suffix = dot + suffix
            if not plain_file(path) or (video_id not in known and not path.name.endswith(PART)):
                moved.append(self._set_aside(path))
            elif path.name.endswith(PART) or (suffix in MEDIA and video_id not in completed):
                path.unlink(missing_ok=True)
                removed.append(path.name)
            elif suffix not in (*MEDIA, RECORD):
                moved.append(self._set_aside(path))
        return removed, moved

    def _set_aside(self, path: Path) -> str:
        """Move `path` (the entry itself, a link never followed) into `orphans/`; its new name."""
        aside = self.folder / ORPHANS
        aside.mkdir(exist_ok=True)
        target, n = aside / path.name, 0
        while os.path.lexists(target):
            n += 1
            target = aside / f"{path.name}.{n}"
        os.replace(path, target)
        return target.name

    def remove_orphans(self, known: set[str]) -> list[str]:
        """While serving: remove every file whose job is not in `known` (a job deleted or expired
        while its files were being written); their names."""
        removed = []
        for path in self.files.iterdir():
            if path.name.split(".")[0] not in known and plain_file(path):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
        if self.temporary:
            shutil.rmtree(self.folder, ignore_errors=True)


def _refuse_links(folder: Path) -> None:
    """OSError if one of the folder's own entries is a link: followed, it would let the server
    read, write or delete another folder's files."""
    for name in OWN_ENTRIES:
        if (folder / name).is_symlink():
            raise OSError(f"{folder / name} is a link, and the state folder's own files are never reached "
                          f"through one: make it a plain {'folder' if name in (FILES, ORPHANS) else 'file'} "
                          "(or point --state-dir at the folder wanted)")


def _owner_secret(folder: Path) -> bytes:
    """32 random bytes kept in the folder (owner-only), made once: a job's owner is an HMAC of
    its API key under them, so the database alone cannot be used to guess a short key. Kept
    twice: one damaged (emptied, cut, gone) is written again from the other; with both lost,
    the jobs made before are no key's any more (404 to every key), and the log says so."""
    paths = (folder / OWNER_SECRET, folder / OWNER_SECRET_COPY)
    found = [_read_secret(path) for path in paths]
    secret = next((value for value in found if value is not None), None)
    if secret is None:
        if os.path.lexists(paths[0]):
            logger.error("the owner secret %s is damaged and has no good copy: a new one is made, and the videos "
                         "made before it are no API key's any more", paths[0])
        secret = secrets.token_bytes(SECRET_BYTES)
    elif found[0] is None and os.path.lexists(paths[0]):
        logger.warning("the owner secret %s was damaged: written again from its copy", paths[0])

    def write(file) -> None:
        os.fchmod(file.fileno(), 0o600)  # before the secret is in it
        file.write(secret)

    for path, value in zip(paths, found):
        if value != secret:
            write_whole(path, write)
    return secret


def _read_secret(path: Path) -> bytes | None:
    """The secret in `path`; None when it is missing or not one (the wrong length)."""
    try:
        data = read_plain_file(path, SECRET_BYTES)
    except (FileNotFoundError, ValueError):
        return None
    return data if len(data) == SECRET_BYTES else None


def _connect(path: Path) -> sqlite3.Connection:
    """The database, in WAL mode, its table made, read once through (a corrupt one raises here
    rather than at the first write). Used from the event loop's thread and the pool's: one lock
    (`VideoState._lock`) orders every call."""
    db = sqlite3.connect(path, check_same_thread=False)
    os.chmod(path, 0o600)  # rows may hold signed URLs (a job's `urls`); SQLite gives -wal and -shm its mode
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses no commit
        db.execute(SCHEMA)
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        db.execute("SELECT * FROM videos").fetchall()
        present = {row[1] for row in db.execute("PRAGMA table_info(videos)")}
        if missing := sorted(set(COLUMNS) - set(ADDED_COLUMNS) - present):
            raise sqlite3.DatabaseError(f"its videos table has no column {', '.join(missing)}: not this server's")
    except sqlite3.DatabaseError:
        db.close()
        raise
    _add_columns(db, path, present)
    return db


def _add_columns(db: sqlite3.Connection, path: Path, present: set[str]) -> None:
    """The columns (and the webhooks table) a database made by an earlier version lacks, added;
    OSError (the folder is then not used, and the database kept as it is) when it cannot be
    changed now (locked, read-only): that is no sign of a corrupt database."""
    try:
        for column in ADDED_COLUMNS:
            if column not in present:
                db.execute(f"ALTER TABLE videos ADD COLUMN {column}")
        db.execute(DELIVERY_SCHEMA)
        if "owner" not in {row[1] for row in db.execute("PRAGMA table_info(webhooks)")}:
            db.execute("ALTER TABLE webhooks ADD COLUMN owner")
    except sqlite3.OperationalError as e:
        db.close()
        raise OSError(f"the video jobs database {path} cannot be updated: {e}") from None


def _write_private(file, data: bytes) -> None:
    os.fchmod(file.fileno(), 0o600)  # a record may hold signed URLs (a job's `urls`): before they are in it
    file.write(data)
