"""Fresh host buffers for adapters, backed by transparent huge pages where the kernel gives them,
and filled on several threads.

A never-seen adapter is read into one new buffer and packed into another (hundreds of MB
for a FLUX.1 LoRA). Written the first time, a buffer of 4 KiB pages costs a page fault
per page: on a 428 MiB adapter that was most of the cold read (about 120 ms of a 140 ms
copy on a 2-core machine). Asked for huge pages (`madvise(MADV_HUGEPAGE)`, which Linux
honours when transparent huge pages are `always` or `madvise`), it is 512x fewer faults
and the copy costs what copying into warm memory does. Elsewhere (no `madvise`, small
buffers) a buffer is plain `torch.empty`.

The buffer is an anonymous private mapping owned by the tensor made over it: it is
unmapped when the last tensor viewing it is freed.

One thread copies from the page cache or between buffers at a few GB/s; a large adapter is
read and packed in pieces on `COPY_THREADS` threads (file reads and torch copies release the
GIL), which on a 2-core machine halves both.
"""

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

HUGE_PAGE = 2 * 2**20
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
PARALLEL_FROM = 64 * 2**20  # smaller buffers are filled on the caller's thread
_HUGE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def host_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, on huge pages when it is large enough."""
    if not _HUGE or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
        pass
    return torch.frombuffer(mapping, dtype=torch.uint8)


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements of `dtype` (see `host_bytes`)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return host_bytes(numel * itemsize).view(dtype)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def in_pieces(nbytes: int) -> int:
    """How many pieces to fill a buffer of `nbytes` in: 1 below `PARALLEL_FROM`."""
    return 1 if nbytes < PARALLEL_FROM else COPY_THREADS


def byte_ranges(nbytes: int) -> list[tuple[int, int]]:
    """`nbytes` cut into `in_pieces(nbytes)` ranges (start, end), each starting on a huge page."""
    step = max(HUGE_PAGE, -(-nbytes // in_pieces(nbytes) // HUGE_PAGE) * HUGE_PAGE)
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def run_all(jobs: list[Callable[[], None]]) -> None:
    """Run `jobs` on the shared copy threads and wait for all; the first error is raised. The
    jobs must not call `run_all` themselves (they would wait on the threads they hold)."""
    global _pool
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="loraswap-copy")
    futures = [_pool.submit(job) for job in jobs]
    wait(futures)  # all of them, failed or not: none may still write once the caller moves on
    for future in futures:
        future.result()
