"""The SHA-256 of adapter files, for the record each generated image carries.

The store hashes a file as it reads it (`AdapterStore._read_and_hash`, on a cache miss): the
read hands the pieces it brings in to a `ReadDigest`, whose own thread hashes them in the
file's order as they join up. The store keeps the digest with the cache entry, and the
engine reports it with what ran (`engine.calls.AdapterRan`): a record never locates,
downloads nor reads a file again.

The read outruns the hashing, so a digest keeps at most `MAX_HELD_BYTES` of pieces waiting
to be hashed and lets go of any piece past that. Once the read is done, `finish` reads from
the file, still open, what it did not keep, in the file's order: whatever no reader brought
in (a tensor the parse skips) and the pieces let go. A file the hashing keeps up with is
read once; of a larger one, what the hashing fell behind on is read twice (the second time
from the page cache).
"""

import hashlib
import heapq
import itertools
import logging
import os
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The pieces a digest keeps waiting to be hashed. A cold read brings a file in at about
# 10 GB/s and the hashing (two SHA-256 updates a byte) takes it at about 1 GB/s at best: kept
# whole, the pieces would be nearly the whole file (up to 2 GiB a read, several reads at once),
# outside the host cache's budget. This is eight of the GPU read's 8 MiB chunks: enough for
# the hashing never to wait on a read that runs in the file's order.
MAX_HELD_BYTES = 64 * 2**20
READ_BACK_BYTES = 1 << 20  # what `finish` reads from the file at a time


@dataclass(frozen=True)
class FileDigest:
    sha256: str  # of the whole file: what Civitai and the hub list as its SHA256
    tensors_sha256: str  # of the bytes after the safetensors header: kohya's hash, which A1111 shortens


class ReadDigest:
    """Both digests of one safetensors file, from the pieces of it a read brings in.

    The read opens the file (`begin`: the bytes before the data section) and hands in each piece
    of the data section it reads (`add`, from any thread, never waiting); a thread of the
    digest's own hashes them in the file's order as soon as they join up. A piece is kept until
    it is hashed only while the pieces kept come to at most `max_held` bytes; past that it is
    left out. Once the read is done, `finish` hashes what was left out from the file (the
    digest's own descriptor of it: the caller may close its own); `cancel` ends a failed read.
    A read made again from the start (read whole after in place) calls `begin` again."""

    def __init__(self, max_held: int = MAX_HELD_BYTES):
        self.max_held = max_held
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pieces: list = []  # heap of (offset in the data section, order, piece)
        self._held = 0  # bytes of `_pieces`, and of pieces being copied to join them
        self.result: FileDigest | None = None

    @property
    def held(self) -> int:
        """The bytes of the pieces kept waiting to be hashed (at most `max_held`)."""
        with self._cond:
            return self._held

    def begin(self, file) -> None:
        """The file (a `formats.CheckedFile`) is open: hash from its start, anew."""
        self.cancel()
        with self._cond:
            self._fd = os.dup(file.fd)  # the same open file, however long the reader keeps its own
            self._data_offset, self._data_len = file.data_offset, file.data_len
            self._next, self._ended = 0, None  # data bytes hashed; "done"/"cancelled"
            self._pieces, self._held, self._order = [], 0, itertools.count()
            self._whole, self._tensors = hashlib.sha256(file.head), hashlib.sha256()
            self.result = None
            self._thread = threading.Thread(target=self._run, name="loraswap-hash", daemon=True)
        self._thread.start()

    def add(self, offset: int, piece: torch.Tensor, copy: bool = False) -> None:
        """The bytes of `piece` (a contiguous CPU tensor) are the data section's from `offset`.
        Kept, not copied, until hashed (the reader must leave it as it is), or left out when it
        would take the pieces kept past `max_held`. `copy`: the reader reuses `piece`'s memory
        at once, so a piece kept is a copy of it (made only once it is to be kept)."""
        nbytes = piece.nbytes
        with self._cond:
            if (self._thread is None or offset + nbytes <= self._next
                    or self._held + nbytes > self.max_held):
                return
            self._held += nbytes
            order = self._order  # this read's (a `begin` meanwhile starts another)
        if copy:
            piece = piece.clone()
        with self._cond:
            if self._thread is not None and self._order is order:  # (a read ended meanwhile let go of all)
                heapq.heappush(self._pieces, (offset, next(order), piece))
                self._cond.notify_all()

    def finish(self) -> FileDigest | None:
        """The digests, once the rest is hashed (None, logged, when that failed)."""
        thread = self._end("done")
        if thread is not None:
            thread.join()
        return self.result

    def cancel(self) -> None:
        """The read failed: stop hashing."""
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
            while (data := self._next_bytes()) is not None:
                self._hash(data)
            if self._ended == "done":
                self.result = FileDigest(self._whole.hexdigest(), self._tensors.hexdigest())
        except Exception as e:  # a record is best-effort: it never fails the read of the adapter
            logger.warning("an adapter's file could not be hashed for the images' records: %s", e)
        finally:
            os.close(self._fd)
            with self._cond:
                self._thread = None
                self._pieces, self._held = [], 0
                self._cond.notify_all()

    def _next_bytes(self) -> memoryview | None:
        """The bytes that continue what is hashed, once a piece brings them in (once the read is
        done: read from the file where no piece kept does); None at the end."""
        with self._cond:
            while True:
                self._drop_hashed()
                if self._ended == "cancelled" or (self._ended == "done" and self._next >= self._data_len):
                    return None
                if self._pieces and self._pieces[0][0] <= self._next:
                    offset, _, piece = self._pieces[0]
                    return memoryview(piece.reshape(-1).view(torch.uint8).numpy())[self._next - offset:]
                if self._ended == "done":
                    start = self._next
                    end = min(self._pieces[0][0] if self._pieces else self._data_len, start + READ_BACK_BYTES)
                    break
                self._cond.wait()
        return memoryview(self._read_back(start, end))  # outside the lock: a reader late to add waits on no read

    def _drop_hashed(self) -> None:
        """Let go of the pieces whose bytes are all hashed (a piece read twice, too)."""
        while self._pieces and self._pieces[0][0] + self._pieces[0][2].nbytes <= self._next:
            self._held -= heapq.heappop(self._pieces)[2].nbytes

    def _read_back(self, start: int, end: int) -> bytes:
        """The data section's bytes [start, end), read from the file."""
        data = os.pread(self._fd, end - start, self._data_offset + start)
        if len(data) != end - start:
            raise OSError("the file ended early")
        return data

    def _hash(self, data: memoryview) -> None:
        self._whole.update(data)
        self._tensors.update(data)
        with self._cond:
            self._next += len(data)
            self._cond.notify_all()
