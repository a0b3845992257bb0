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

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .file_data import FileData, NotInFile
from .formats import read_range
from .host_memory import COPY_THREADS, run_all

CHUNK_BYTES = 8 * 2**20  # one staging buffer: a pread and a copy each, small enough to overlap the two
STAGING_BUFFERS = 2 * COPY_THREADS  # each reading thread fills one while the GPU copies its last


@dataclass
class _Staging:
    buffer: torch.Tensor  # pinned, CHUNK_BYTES
    copied: torch.cuda.Event | None = None  # after which the GPU has taken what it held


class StagingBuffers:
    """Pinned host buffers on which a device's cold reads take turns; made once (`warm`).
    Each is handed to one chunk at a time and reused once the GPU has copied it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: queue.Queue[_Staging] = queue.Queue()
        self._made = False
        self._lock = threading.Lock()
        self.stream: torch.cuda.Stream | None = None

    def warm(self) -> None:
        """Pin the buffers now (tens of ms), so that no request's read pays for it."""
        with self._lock:
            if self._made:
                return
            self.stream = torch.cuda.Stream(self.device)
            for _ in range(STAGING_BUFFERS):
                self._free.put(_Staging(torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)))
            self._made = True

    def copy_file(self, fd: int, offset: int, out: torch.Tensor, adapter_id: str) -> None:
        """The file's bytes from `offset` into `out` (a uint8 tensor on the GPU, filled whole),
        chunk by chunk through the staging buffers. On return the copies are ordered before
        whatever the caller's stream does next."""
        self.warm()
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # `out` was allocated on the caller's stream
        out.record_stream(self.stream)

        def chunk(start: int) -> None:
            staging = self._free.get()
            try:
                if staging.copied is not None:
                    staging.copied.synchronize()
                n = min(CHUNK_BYTES, out.numel() - start)
                read_range(fd, staging.buffer[:n], offset + start, adapter_id)
                with torch.cuda.stream(self.stream):
                    out[start: start + n].copy_(staging.buffer[:n], non_blocking=True)
                    staging.copied = torch.cuda.Event()
                    staging.copied.record(self.stream)
            finally:
                self._free.put(staging)

        try:
            run_all([lambda s=start: chunk(s) for start in range(0, out.numel(), CHUNK_BYTES)])
        finally:  # even after an error, nothing the caller frees next may still be in flight
            caller.wait_stream(self.stream)


_staging: dict[torch.device, StagingBuffers] = {}
_staging_lock = threading.Lock()


def staging_buffers(device: torch.device) -> StagingBuffers:
    """The process's staging buffers for `device` (one set per GPU)."""
    device = torch.device(device.type, torch.cuda.current_device() if device.index is None else device.index)
    with _staging_lock:
        return _staging.setdefault(device, StagingBuffers(device))


def pack_from_files(factors: Sequence[torch.Tensor], starts: Sequence[int], numel: int, dtype: torch.dtype,
                    device: torch.device, files: Sequence[FileData]) -> torch.Tensor:
    """A flat `dtype` buffer of `numel` on `device` with factor i at `starts[i]`, zero between.

    A factor standing in for bytes of one of `files` is cut out of that file's data on the
    GPU; any other (a small tensor the parse read) is copied up with the rest of them in one
    copy. Raises `NotInFile` for a stand-in none of `files` owns."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    data = {id(file): _file_on_device(file, device) for file in files}
    sources, targets, small = [], [], []
    for tensor, at in zip(factors, starts):
        target = flat[at: at + tensor.numel()]
        if not tensor.is_meta:
            small.append((tensor, target))
            continue
        file = next((f for f in files if f.owns(tensor)), None)
        if file is None or not tensor.is_contiguous():
            raise NotInFile("a factor computed from the file's tensors, not cut out of one")
        begin = tensor.storage_offset() * tensor.element_size()
        sources.append(data[id(file)][begin: begin + tensor.nbytes].view(tensor.dtype))
        targets.append(target)
    if small:
        up = torch.cat([t.reshape(-1).to(dtype) for t, _ in small]).to(device)
        sources += list(up.split([t.numel() for t, _ in small]))
        targets += [target for _, target in small]
    if targets:
        torch._foreach_copy_(targets, sources)
    return flat


def _file_on_device(file: FileData, device: torch.device) -> torch.Tensor:
    """The file's data section on `device` (read straight into it on the CPU)."""
    out = torch.empty(file.file.data_len, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        staging_buffers(device).copy_file(file.file.fd, file.file.data_offset, out, file.adapter_id)
    else:
        read_range(file.file.fd, out, file.file.data_offset, file.adapter_id)
    return out
