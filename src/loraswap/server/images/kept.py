"""Images answered by URL (OpenAI's `response_format: "url"`), kept in the state folder for a TTL.

    images/OWNER/ID.EXT        an image: OWNER names the API key that made it (the digest of
                               `videos.VideoStore.owner_of`; `open` on a server without API
                               keys), ID is 32 random hex digits, EXT png, jpeg or webp
    images/OWNER/ID.EXT.part   one being written, renamed to its name once whole

A URL names the file (`/v1/images/files/ID.EXT`) and a request reaches only its own key's
folder, so another key's image is unknown to it (404), and without keys only the id, which
cannot be guessed, reaches one. A file is kept `ttl_s` from when it was written (its
modification time, so the TTL counts across restarts), then deleted: on the next keep or
read, and every `sweep_interval_s` by `sweep_every` on an idle server (a file that cannot be
deleted stays listed, and is tried again at the next sweep). All files together take at most
`max_bytes` (and `MAX_FILES`): past it, the owner holding the most loses its oldest first, so
one key's flood deletes its own images before any other key's. A start finds the files the
last server left and serves them until their TTL; it deletes the `.part` files a crash left,
and leaves any other name alone (never following a link).
"""

import asyncio
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fastapi.concurrency import run_in_threadpool

from loraswap.errors import LoraswapError
from loraswap.server.state_files import read_plain_file

logger = logging.getLogger("loraswap.server")

FOLDER = "images"
OPEN = "open"  # the owner folder of a server without API keys
PART = ".part"
MAX_FILES = 100_000  # with tiny images the byte cap alone would let the index grow to millions
FREE_DISK_BYTES = 16 * 2**20  # less free disk than this: a request for URLs is refused before it generates
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
EXTENSIONS = {media: ext for ext, media in MEDIA_TYPES.items()}
NAME = re.compile(r"[0-9a-f]{32}\.(png|jpeg|webp)")
OWNER = re.compile(r"[0-9a-f]{32}|" + OPEN)


class ImageNotFound(LoraswapError):
    status = 404
    code: ClassVar[str | None] = "image_not_found"


class ImageNotKept(LoraswapError):
    """The image could not be written to the state folder (too large for the cap, a full disk)."""

    status = 507
    code: ClassVar[str | None] = "image_not_kept"
    headers: ClassVar[dict[str, str]] = {"x-should-retry": "false"}  # openai-python retries a 5xx unless told


@dataclass(frozen=True)
class _Kept:
    size: int
    made: float  # wall-clock seconds, as the file's modification time


class KeptImages:
    """The images kept for their URLs, owned by the app (`app.state.kept_images`). Thread-safe:
    the routes call it on the thread pool (it reads and writes files)."""

    def __init__(self, state_folder: Path, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.time):
        self.folder = Path(state_folder) / FOLDER
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, _Kept] = OrderedDict()  # oldest first
        self._owners: dict[Path, OrderedDict[Path, _Kept]] = {}  # owner folder -> its files, oldest first
        self._owner_bytes: dict[Path, int] = {}
        self._bytes = 0
        if self.folder.is_symlink():
            raise ValueError(f"{self.folder} is a link, and the state folder's own files are never reached through "
                             "one: make it a plain folder (or point --state-dir at the folder wanted)")
        self._find_kept()

    @property
    def sweep_interval_s(self) -> float:
        return min(60.0, self.ttl_s)

    def keep(self, data: bytes, ext: str, owner: str | None) -> str:
        """Write the image for `owner` (None: everyone) and answer its file name, `ID.EXT`;
        ImageNotKept (507) when it cannot be."""
        if len(data) > self.max_bytes:
            raise ImageNotKept(f"the image is {len(data)} bytes, more than the server keeps for URLs "
                               f"({self.max_bytes}, --image-url-max-mb): ask for response_format b64_json")
        name = f"{secrets.token_hex(16)}.{ext}"
        path = self._owner_folder(owner) / name
        made = self.clock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # made on first use
            if self.folder.is_symlink() or path.parent.is_symlink():
                raise OSError(f"{path.parent} is a link")
            _write_whole(path, data, made)
        except OSError as e:
            logger.error("an image could not be kept for its URL in %s: %s", path.parent, e)
            raise ImageNotKept("the image could not be written to the server's state folder: ask for "
                               "response_format b64_json") from None
        with self._lock:
            self._add(path, _Kept(len(data), made))
            self._drop_over_caps(keep=path)
        self.sweep()
        return name

    def check_room(self) -> None:
        """ImageNotKept (507) before generating when the state folder's disk is all but full:
        the images could not be kept (the cap is checked per image, once its size is known)."""
        try:
            free = shutil.disk_usage(self.folder if self.folder.is_dir() else self.folder.parent).free
        except OSError as e:
            logger.error("the state folder's free disk could not be read (%s): %s", self.folder, e)
            return  # `keep` answers for its own write
        if free < FREE_DISK_BYTES:
            raise ImageNotKept(f"the server's state folder has {free} bytes free, too few to keep images for URLs: "
                               "ask for response_format b64_json")

    def discard(self, name: str, owner: str | None) -> None:
        """Delete the image `name` of `owner`'s now (one of a request that failed after it)."""
        if NAME.fullmatch(name):
            with self._lock:
                self._remove(self._owner_folder(owner) / name)

    def read(self, name: str, owner: str | None) -> tuple[bytes, str, float]:
        """The image `name` of `owner`'s: (bytes, media type, seconds left to its TTL);
        ImageNotFound (404) for an unknown, expired or another key's name."""
        self.sweep()
        path = self._owner_folder(owner) / name if NAME.fullmatch(name) else None
        with self._lock:
            kept = self._files.get(path) if path is not None else None
            left = kept.made + self.ttl_s - self.clock() if kept is not None else 0.0
            if kept is not None and left <= 0:
                self._remove(path)
        try:
            if left > 0:
                return read_plain_file(path), MEDIA_TYPES[name.rsplit(".", 1)[1]], left
        except OSError:  # deleted beside the server: as good as expired
            with self._lock:
                self._remove(path)
        raise ImageNotFound(f"no image {name[:80]!r}: unknown, made with another API key, or expired (images "
                            f"answered by URL are kept {self.ttl_s:g} s)")

    def sweep(self) -> None:
        """Delete the images past their TTL, oldest first (one made later under a clock set back
        waits for those before it; `read` refuses it all the same)."""
        now = self.clock()
        with self._lock:
            for path, kept in list(self._files.items()):
                if kept.made + self.ttl_s > now:
                    break
                self._remove(path)  # (one that cannot be deleted stays listed: tried again next time)

    async def sweep_every(self) -> None:
        """Sweep every `sweep_interval_s` until cancelled (the app's lifespan runs it)."""
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            await run_in_threadpool(self.sweep)

    def kept_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def _owner_folder(self, owner: str | None) -> Path:
        owner = owner or OPEN
        if not OWNER.fullmatch(owner):
            raise ValueError(f"an owner is 32 hex digits, not {owner!r}")
        return self.folder / owner

    def _find_kept(self) -> None:
        """The images the last server left, oldest first; its `.part` files deleted. An entry
        that cannot be looked at is logged and left alone; a folder that cannot be listed stops
        the start with what to fix."""
        found = []
        try:
            owners = [entry for entry in self.folder.iterdir() if OWNER.fullmatch(entry.name)] \
                if self.folder.is_dir() else []
            for owner in owners:
                if not owner.is_symlink() and owner.is_dir():
                    found += self._found_in(owner)
        except OSError as e:
            raise ValueError(f"the folder of the images answered by URL, {self.folder}, cannot be read ({e}): make "
                             "it readable and writable by the server's user, or point --state-dir elsewhere") from e
        with self._lock:
            for made, size, path in sorted(found):
                self._add(path, _Kept(size, made))
            self._drop_over_caps()
        self.sweep()
        if found:
            logger.info("%d images answered by URL are kept from before the restart", len(self._files))

    @staticmethod
    def _found_in(owner: Path) -> list[tuple[float, int, Path]]:
        """(modified, size, path) of each image in one owner's folder; its `.part` files deleted."""
        found = []
        for path in owner.iterdir():
            try:
                if path.name.endswith(PART) and not path.is_symlink():
                    path.unlink(missing_ok=True)
                elif NAME.fullmatch(path.name) and not path.is_symlink() and path.is_file():
                    facts = path.stat()
                    found.append((facts.st_mtime, facts.st_size, path))
            except OSError as e:  # gone since it was listed, or not ours to read
                logger.warning("a kept image's file is left alone: %s", e)
        return found

    def _add(self, path: Path, kept: _Kept) -> None:
        self._files[path] = kept
        self._owners.setdefault(path.parent, OrderedDict())[path] = kept
        self._owner_bytes[path.parent] = self._owner_bytes.get(path.parent, 0) + kept.size
        self._bytes += kept.size

    def _remove(self, path: Path) -> bool:
        """Delete the file and forget it; False when it could not be deleted: it stays listed
        (and counted against the caps), tried again by the next sweep."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("could not delete the kept image %s (tried again later): %s", path, e)
            return False
        kept = self._files.pop(path, None)
        if kept is not None:
            self._bytes -= kept.size
            owned = self._owners[path.parent]
            del owned[path]
            self._owner_bytes[path.parent] -= kept.size
            if not owned:
                del self._owners[path.parent], self._owner_bytes[path.parent]
        return True

    def _drop_over_caps(self, keep: Path | None = None) -> None:
        """Delete images until under the caps: each time the oldest of the owner holding the most
        (the oldest of all among owners holding as much); never `keep`, the one just written."""
        spared = {keep}
        while self._bytes > self.max_bytes or len(self._files) > MAX_FILES:
            victim = self._next_victim(spared, by_count=self._bytes <= self.max_bytes)
            if victim is None:
                return
            if not self._remove(victim):
                spared.add(victim)  # cannot be deleted now: the next one

    def _next_victim(self, spared: set, by_count: bool) -> Path | None:
        candidates = []
        for owner, files in self._owners.items():
            oldest = next((path for path in files if path not in spared), None)
            if oldest is not None:
                held = len(files) if by_count else self._owner_bytes[owner]
                candidates.append((-held, files[oldest].made, oldest))
        return min(candidates)[2] if candidates else None


def _write_whole(path: Path, data: bytes, made: float) -> None:
    """`data` into `path` under a temporary name (never through a link), renamed once whole; its
    modification time `made`, from which its TTL counts."""
    part = path.with_name(path.name + PART)
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before its name says so: a crash leaves no empty image
        os.utime(part, (made, made))
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
