"""The SHA-256 of adapter files, for the record each generated image carries.

The store hashes a file as it reads it (`AdapterStore._read_and_hash`, on a cache miss): the
read hands the bytes it brings in to a `ReadDigest`, whose own thread hashes them in the
file's order as they come (one read of the file, not one more for the hash). The store keeps
the digest with the cache entry, and the engine reports it with what ran
(`engine.calls.AdapterRan`): a record never locates, downloads nor reads a file again.
`hash_file` hashes a file by reading it, for a file no read brings in.
"""

import hashlib
import heapq
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from loraswap.adapters.files.location import AdapterLocation, file_stamp

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


class ReadDigest:
    """Both digests of one safetensors file, from the pieces of it a read brings in.

    The read opens the file (`begin`: the bytes before the data section) and hands in each piece
    of the data section it reads (`add`, from any thread; a CPU tensor kept, not copied, until
    it is hashed, so the reader leaves it as it is: a reader that reuses its buffer hands in a
    copy); a thread of the digest's own hashes them in the file's order as soon as they join
    up, and no reader ever waits on it. Once the read is done, `finish` hashes what no reader
    brought in (a tensor the parse dropped) from the file, still open; `cancel` ends a failed
    read. A read made again from the start (read whole after in place) calls `begin` again."""

    def __init__(self):
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.result: FileDigest | None = None

    def begin(self, file) -> None:
        """The file (a `formats.CheckedFile`) is open: hash from its start, anew."""
        self.cancel()
        with self._cond:
            self._file, self._next, self._ended = file, 0, None  # data bytes hashed; "done"/"cancelled"
            self._pieces: list = []  # heap of (offset in the data section, order, piece)
            self._order = itertools.count()
            self._whole, self._tensors = hashlib.sha256(file.head), hashlib.sha256()
            self._thread = threading.Thread(target=self._run, name="loraswap-hash", daemon=True)
        self._thread.start()

    def add(self, offset: int, piece: torch.Tensor) -> None:
        """The bytes of `piece` (a contiguous CPU tensor) are the data section's from `offset`."""
        with self._cond:
            if self._thread is not None:
                heapq.heappush(self._pieces, (offset, next(self._order), piece))
                self._cond.notify_all()

    def finish(self) -> FileDigest | None:
        """The digests, once the rest is hashed (None, logged, when that failed)."""
        thread = self._end("done")
        if thread is not None:
            thread.join()
        return self.result

    def cancel(self) -> None:
        """The read failed: stop hashing, and release any reader waiting."""
        thread = self._end("cancelled")
        if thread is not None:
            thread.join()

    def _end(self, how: str) -> threading.Thread | None:
        with self._cond:
            thread, self._ended = self._thread, how if self._thread is not None else None
            self._cond.notify_all()
        return thread

    def _run(self) -> None:
        try:
            while (piece := self._next_piece()) is not None:
                self._hash(piece)
            if self._ended == "done":
                self.result = FileDigest(self._whole.hexdigest(), self._tensors.hexdigest())
        except Exception as e:  # a record is best-effort: it never fails the read of the adapter
            logger.warning("an adapter's file could not be hashed for the images' records: %s", e)
            with self._cond:
                self._ended = "cancelled"
        finally:
            with self._cond:
                self._thread = None
                self._cond.notify_all()

    def _next_piece(self) -> memoryview | None:
        """The bytes that continue what is hashed, once they are in (once done: read from the
        file where no reader brought them in); None at the end."""
        with self._cond:
            while True:
                while self._pieces and self._pieces[0][0] + self._pieces[0][2].nbytes <= self._next:
                    heapq.heappop(self._pieces)  # hashed already (a piece read twice)
                if self._ended == "cancelled" or (self._ended == "done" and self._next >= self._file.data_len):
                    return None
                if self._pieces and self._pieces[0][0] <= self._next:
                    offset, _, piece = self._pieces[0]
                    return memoryview(piece.reshape(-1).view(torch.uint8).numpy())[self._next - offset:]
                if self._ended == "done":
                    end = self._pieces[0][0] if self._pieces else self._file.data_len
                    return memoryview(_read_gap(self._file, self._next, min(end, self._next + CHUNK_BYTES)))
                self._cond.wait()

    def _hash(self, data: memoryview) -> None:
        self._whole.update(data)
        self._tensors.update(data)
        with self._cond:
            self._next += len(data)
            self._cond.notify_all()


def _read_gap(file, start: int, end: int) -> bytes:
    """The data section's bytes [start, end) no reader brought in, read from the open file."""
    data = os.pread(file.fd, end - start, file.data_offset + start)
    if len(data) != end - start:
        raise OSError("the file ended early")
    return data
