"""Compiling the swap kernels' variants on many threads at once, for the start-up warm-ups.

A warm-up (`kernels.warm_up`, `float8_warm_up.warm_up_float8`) launches every variant a
swap can need, so that no request pays for a compile. One at a time, a float8 model's
variants take 70-90 s on an H100 machine's host. Triton's compiler (its MLIR passes, LLVM
and `ptxas`) runs without Python's lock, so the variants compile side by side: a warm-up is
run twice, first with every launch replaced by Triton's `warmup` (a compile, submitted to a
thread pool through Triton's `AsyncCompileMode`), then for real, each variant now in
Triton's memory. Where Triton has no `AsyncCompileMode`, or off CUDA, it runs once, as before.
"""

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch

logger = logging.getLogger(__name__)

_compile_only: ContextVar[bool] = ContextVar("compile_only", default=False)


def launch(kernel, grid: tuple, *args, **options) -> None:
    """`kernel[grid](*args, **options)`, or inside `compiled_in_parallel`'s first pass only
    its compile, submitted to the pool."""
    if _compile_only.get():
        kernel.warmup(*args, grid=grid, **options)
    else:
        kernel[grid](*args, **options)


def compile_threads() -> int:
    """Threads for the compiles: the host's cores this process may use, at most 16 (on an
    H100 machine's 16 cores, FLUX.1's float8 warm-up took 16.6 s on 8 threads, 15.2 on 16)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(16, cores)


def compiled_in_parallel(device: torch.device, warm_up: Callable[[], None], threads: int | None = None) -> None:
    """Run `warm_up` (launches through `launch`) with its kernels compiled `threads` at a
    time first, where that can be done (CUDA, a Triton with `AsyncCompileMode`); a variant
    that fails to compile raises here, as its launch would have."""
    threads = threads or compile_threads()
    mode = _async_compile_mode() if device.type == "cuda" and threads > 1 else None
    if mode is not None:
        start = time.perf_counter()
        token = _compile_only.set(True)
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, mode(pool):
                warm_up()
        finally:
            _compile_only.reset(token)
        logger.info("swap kernels compiled on %d threads in %.1f s", threads, time.perf_counter() - start)
    warm_up()


def _async_compile_mode():
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # Triton before 3.4, or none
        logger.info("Triton has no AsyncCompileMode: the swap kernels compile one at a time")
        return None
    return AsyncCompileMode
