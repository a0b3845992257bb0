"""Video jobs on disk, so that a restart (a deploy, the OOM killer, a lost node) loses none.

The state folder (`--state-dir`, default ~/.cache/loraswap/state):

    lock                  held (flock) by the one server using the folder
    videos.sqlite3        one row a job (SQLite, WAL mode), with -wal and -shm beside it
    owner-secret          the key of the digests naming the API key that made each job
    videos/ID.mp4         a completed job's MP4
    videos/ID.png         its first frame, lossless (the route sends it as WebP)
    videos/ID.*.part      a file being written: renamed to its name once whole

One writer: every database call takes one lock, and only the server holding the folder's
`lock` writes there. A file is visible under its name only once whole, so a crash leaves
at most a `.part` file, removed at the next start. A folder that cannot be used (another
server holds it, it cannot be created) never stops a start: the jobs then live in a
temporary folder, lost at a restart, and the log says so. A database that cannot be read
(truncated, garbage) is moved aside (`videos.sqlite3.corrupt-TIME`) and a fresh one made.
"""

import fcntl
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

from ..paths import user_cache

logger = logging.getLogger("loraswap.server")

DATABASE = "videos.sqlite3"
FILES = "videos"
PART = ".part"
# what a failed write raises: the disk (full, gone, read-only) or the database on it
WRITE_ERRORS = (OSError, sqlite3.Error)
COLUMNS = ("id", "request", "model", "target", "fps", "created_at", "finished_at", "expires_at", "error",
           "seconds", "size", "attempts", "owner")
ADDED_COLUMNS = ("owner",)  # columns a database made by an earlier version lacks: added when it is opened
OWNER_SECRET = "owner-secret"  # the key of the digests that say which API key made a job
SCHEMA = f"CREATE TABLE IF NOT EXISTS videos ({', '.join(COLUMNS)}, PRIMARY KEY (id))"


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
            logger.error("video jobs are kept in %s and lost at a restart: %s", self.folder, e)

    def _open(self, folder: Path) -> None:
        self.folder = self._claim(folder)
        self.files = self.folder / FILES
        self.files.mkdir(exist_ok=True)
        self.owner_secret = _owner_secret(self.folder / OWNER_SECRET)
        self._db = self._open_database()

    def _claim(self, folder: Path) -> Path:
        """The folder, created and locked for this server; OSError if another server holds it."""
        folder.mkdir(parents=True, exist_ok=True)
        lock_file = (folder / "lock").open("a")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise OSError(f"{folder} is the state folder of another loraswap server; give each server its own "
                          "--state-dir") from None
        self._lock_file = lock_file
        return folder

    def _open_database(self) -> sqlite3.Connection:
        path = self.folder / DATABASE
        try:
            return _connect(path)
        except sqlite3.DatabaseError as e:  # truncated or not a database: keep it for a look, start afresh
            aside = path.with_name(f"{DATABASE}.corrupt-{int(time.time())}")
            logger.error("the video jobs database %s cannot be read (%s): moved to %s, starting with none",
                         path, e, aside.name)
            for suffix in ("", "-wal", "-shm"):
                if Path(f"{path}{suffix}").exists():
                    os.replace(f"{path}{suffix}", f"{aside}{suffix}")
            return _connect(path)

    # ---------------------------------------------------------------- rows
    def rows(self) -> list[dict]:
        """Every job, oldest first."""
        with self._lock:
            found = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos ORDER BY created_at").fetchall()
        return [dict(zip(COLUMNS, values)) for values in found]

    def save(self, row: dict) -> None:
        """Insert or replace the job's row."""
        with self._lock, self._db:
            self._db.execute(f"INSERT OR REPLACE INTO videos ({', '.join(COLUMNS)}) "
                             f"VALUES ({', '.join('?' * len(COLUMNS))})", [row[column] for column in COLUMNS])

    def remove(self, video_id: str) -> None:
        """The job's files, then its row: a crash between leaves a row whose MP4 is missing,
        which the next start marks failed."""
        self.remove_files(video_id)
        with self._lock, self._db:
            self._db.execute("DELETE FROM videos WHERE id = ?", (video_id,))

    # ---------------------------------------------------------------- files
    def mp4_path(self, video_id: str) -> Path:
        return self.files / f"{video_id}.mp4"

    def thumbnail_path(self, video_id: str) -> Path:
        return self.files / f"{video_id}.png"

    def write_files(self, video_id: str, mp4: bytes, thumbnail: Image.Image) -> None:
        """The MP4 and the first frame, each visible only once whole; on a failure neither is
        left. Blocking: run it off the event loop."""
        try:
            _write_whole(self.thumbnail_path(video_id), lambda f: thumbnail.save(f, format="PNG"))
            _write_whole(self.mp4_path(video_id), lambda f: f.write(mp4))
        except BaseException:
            self.remove_files(video_id)
            raise

    def remove_files(self, video_id: str) -> None:
        for path in self.files.glob(f"{video_id}.*"):
            path.unlink(missing_ok=True)

    def remove_orphans(self, known: set[str], at_start: bool = False) -> list[str]:
        """Remove every file whose job is not in `known` (a job deleted or expired while its
        files were being written) and, `at_start` (nothing is being written), every `.part`
        file a crash left; their names."""
        removed = []
        for path in self.files.iterdir():
            if path.name.split(".")[0] not in known or (at_start and path.name.endswith(PART)):
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


def _owner_secret(path: Path) -> bytes:
    """32 random bytes kept in the folder (owner-only), made once: a job's owner is an HMAC of
    its API key under them, so the database alone cannot be used to guess a short key."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        secret = secrets.token_bytes(32)

        def write(file) -> None:
            os.fchmod(file.fileno(), 0o600)  # before the secret is in it
            file.write(secret)

        _write_whole(path, write)
        return secret


def _connect(path: Path) -> sqlite3.Connection:
    """The database, in WAL mode, its table made, read once through (a corrupt one raises here
    rather than at the first write). Used from the event loop's thread and the pool's: one lock
    (`VideoState._lock`) orders every call."""
    db = sqlite3.connect(path, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash of the process loses no commit
        db.execute(SCHEMA)
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        db.execute("SELECT * FROM videos").fetchall()
    except sqlite3.DatabaseError:
        db.close()
        raise
    _add_columns(db, path)
    return db


def _add_columns(db: sqlite3.Connection, path: Path) -> None:
    """The columns a database made by an earlier version lacks, added; OSError (the folder is
    then not used, and the database kept as it is) when it cannot be changed now (locked,
    read-only): that is no sign of a corrupt database."""
    present = {row[1] for row in db.execute("PRAGMA table_info(videos)")}
    try:
        for column in ADDED_COLUMNS:
            if column not in present:
                db.execute(f"ALTER TABLE videos ADD COLUMN {column}")
    except sqlite3.OperationalError as e:
        db.close()
        raise OSError(f"the video jobs database {path} cannot be updated: {e}") from None


def _write_whole(path: Path, write) -> None:
    """`write(file)` into `path` under a temporary name, renamed once complete and on disk."""
    part = path.with_name(path.name + PART)
    try:
        with part.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
