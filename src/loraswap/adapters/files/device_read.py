"""A never-seen adapter read from its file straight to the GPU and packed there.

Packed on the host, a cold adapter's bytes cross host memory twice before the GPU sees
them: each factor from the page cache into a fresh pageable buffer, then that buffer to the
GPU, which the driver stages through pinned memory of its own at a few GB/s. Here the
file's data section is read, in chunks on several threads, into a few pinned staging
buffers kept for reuse, and each chunk is copied to the GPU as soon as it has been read; the
factors are then cut out of the file's bytes on the GPU, converted to the model's dtype
there, into one packed buffer (the layout `BoundAdapter` packs on the host, bit for bit).
On an H100's host a 428 MiB FLUX.1 LoRA is parsed, checked and packed on the GPU in 45 ms
this way, against 130 ms packed on the host and copied up
(bench/results/runs/2026-12-06-cold-path-h100.md).

The cache keeps a host copy of every adapter; it is copied down from the GPU by the cache's
background thread, off the request's path.
"""

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from loraswap.adapters.files.data import FileData, NotInFile
from loraswap.adapters.files.formats import read_range
from loraswap.adapters.files.host_memory import COPY_THREADS, run_all

CHUNK_BYTES = 8 * 2**20  # one staging buffer: a pread and a copy each, small enough to overlap the two
STAGING_BUFFERS = 2 * COPY_THREADS  # each reading thread fills one while the GPU copies its last


@dataclass
class _Staging:
    buffer: torch.Tensor  # pinned, CHUNK_BYTES
    copied: torch.cuda.Event | None = None  # after which the GPU has taken what it held


class DeviceReadFailed(Exception):
    """Reading or packing an adapter on the GPU failed (out of memory, say): the caller reads
    it on the host instead. Not a RuntimeError, which the parse's own fallback catches."""


class StagingBuffers:
    """One device's cold reads: pinned host buffers they take turns on, made once (`warm`),
    each handed to one chunk at a time and reused once the GPU has copied it; and the read
    stream, a side stream, so that a read waits for no kernel the GPU worker has queued."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: queue.Queue[_Staging] = queue.Queue()
        self._made = False
        self._lock = threading.Lock()
        self.stream: torch.cuda.Stream | None = None

    @property
    def free(self) -> int:
        """How many buffers no read holds now (all of them between reads, once warm)."""
        return self._free.qsize()

    def warm(self) -> None:
        """Pin the buffers now (tens of ms), so that no request's read pays for it."""
        with self._lock:
            if self._made:
                return
            buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGING_BUFFERS)]
            self.stream = torch.cuda.Stream(self.device)
            for buffer in buffers:  # all or none: a failed warm-up is tried again whole
                self._free.put(_Staging(buffer))
            self._made = True

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Run a read on the read stream (its allocations, copies and checks), and wait for it
        at the end: what it made is then complete for any stream."""
        self.warm()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            try:
                yield
            finally:
                self.stream.synchronize()

    def copy_file(self, fd: int, offset: int, nbytes: int, adapter_id: str, digest=None) -> torch.Tensor:
        """The file's `nbytes` from `offset` in a new uint8 tensor on the GPU, chunk by chunk
        through the staging buffers, the copies on the read stream (call inside `reading`);
        `digest` (a `hashes.ReadDigest`) is handed each chunk as read, and copies it only if
        it keeps it (the staging buffer is reused at once: a copy thread never waits on the
        hashing holding one)."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

        def chunk(start: int) -> None:
            try:
                copy_chunk(start)
            except BaseException:
                if digest is not None:  # the read failed: nothing more to hash
                    digest.cancel()
                raise

        def copy_chunk(start: int) -> None:
            staging = self._free.get()
            try:
                if staging.copied is not None:
                    staging.copied.synchronize()
                n = min(CHUNK_BYTES, nbytes - start)
                read_range(fd, staging.buffer[:n], offset + start, adapter_id)
                if digest is not None:
                    digest.add(start, staging.buffer[:n], copy=True)
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    try:
                        out[start: start + n].copy_(staging.buffer[:n], non_blocking=True)
                    finally:  # whatever was queued, the buffer is reused only after it
                        staging.copied = torch.cuda.Event()
                        staging.copied.record(self.stream)
            finally:
                self._free.put(staging)

        run_all([lambda s=start: chunk(s) for start in range(0, nbytes, CHUNK_BYTES)])
        return out


_staging: dict[torch.device, StagingBuffers] = {}
_staging_lock = threading.Lock()


def with_index(device: torch.device) -> torch.device:
    """A CUDA device named by its index (without one, the calling thread's current GPU), so
    that other threads mean the same GPU by it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def staging_buffers(device: torch.device) -> StagingBuffers:
    """The process's staging buffers for `device` (one set per GPU; without an index, the
    calling thread's current one)."""
    device = with_index(device)
    with _staging_lock:
        if device not in _staging:
            _staging[device] = StagingBuffers(device)
        return _staging[device]


def reading_on(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a read packed on `device` runs in: the device's read stream on CUDA."""
    return staging_buffers(device).reading() if device.type == "cuda" else contextlib.nullcontext()


def pack_from_files(factors: Sequence[torch.Tensor], starts: Sequence[int], numel: int, dtype: torch.dtype,
                    device: torch.device, files: Sequence[FileData]) -> torch.Tensor:
    """A flat `dtype` buffer of `numel` on `device` with factor i at `starts[i]`, zero between.

    A factor standing in for bytes of one of `files` is cut out of that file's data on the
    device; any other (a small tensor the parse read) is copied up with the rest of them in
    one copy. Raises `NotInFile` for a stand-in none of `files` owns, before anything is read."""
    in_files, small = [], []  # (file, byte offset, stand-in, where) and (tensor, where)
    for tensor, at in zip(factors, starts):
        if not tensor.is_meta:
            small.append((tensor, at))
            continue
        file = next((f for f in files if f.owns(tensor)), None)
        if file is None or not tensor.is_contiguous():
            raise NotInFile("a factor computed from the file's tensors, not cut out of one")
        in_files.append((file, tensor.storage_offset() * tensor.element_size(), tensor, at))
    flat = torch.zeros(numel, dtype=dtype, device=device)
    data = {id(file): _file_on_device(file, device) for file in {id(f): f for f, *_ in in_files}.values()}
    sources = [data[id(file)][begin: begin + tensor.nbytes].view(tensor.dtype) for file, begin, tensor, _ in in_files]
    targets = [flat[at: at + tensor.numel()] for _, _, tensor, at in in_files]
    if small:
        up = torch.cat([t.reshape(-1).to(dtype) for t, _ in small]).to(device)
        sources += list(up.split([t.numel() for t, _ in small]))
        targets += [flat[at: at + t.numel()] for t, at in small]
    if targets:
        torch._foreach_copy_(targets, sources)
    return flat


def _file_on_device(file: FileData, device: torch.device) -> torch.Tensor:
    """The file's data section on `device` (read straight into it on the CPU)."""
    if device.type == "cuda":
        return staging_buffers(device).copy_file(file.file.fd, file.file.data_offset, file.file.data_len,
                                                 file.adapter_id, file.digest)
    out = torch.empty(file.file.data_len, dtype=torch.uint8)
    read_range(file.file.fd, out, file.file.data_offset, file.adapter_id)
    if file.digest is not None:
        file.digest.add(0, out)
    return out
