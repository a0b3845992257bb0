"""The persistent compile cache: torch.compile's on-disk caches in a folder that outlives the process.

`use_compile_cache(DIR)` points them at DIR before the engine compiles anything:

- `DIR/inductor` (TORCHINDUCTOR_CACHE_DIR): Inductor's FX graph cache and the AOTAutograd
  cache (both switched on here; they are on by default), the compiled C++ and Triton
  kernels and the autotuning results.
- `DIR/triton` (TRITON_CACHE_DIR): Triton's own cache, which also holds loraswap's swap
  kernel (`kernels.py`, compiled at warm-up on CUDA).

torch (2.11 to 2.13) and Triton (3.x) read both variables each time they compile, not at
import, so setting them in the process before its first compile is enough. They belong to
the process: every engine of one process shares the folder. A restarted server still
traces with dynamo, but finds each graph by its key (graph, input shapes, torch and Triton
versions, device, config) and skips Inductor's lowering and the C++/Triton compilers.

A folder that cannot be used never stops the engine: one that cannot be created or written
is skipped with a warning (torch's default folder is used), and one whose entries break
the compile (`use_fresh_compile_cache`) is left as it is while the engine compiles cold in
a fresh temporary folder. torch itself treats unreadable graph entries as misses.
"""

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters

logger = logging.getLogger(__name__)

# our name for each cache -> (torch's counter group, its counter prefix), and the results counted
LOOKUPS = {"fxgraph": ("inductor", "fxgraph_cache_"), "aotautograd": ("aot_autograd", "autograd_cache_")}
RESULTS = ("hit", "miss", "bypass")


def use_compile_cache(directory: Path) -> Path | None:
    """Put torch.compile's and Triton's caches in `directory` (created); the folder, or None
    (with a warning) when this process cannot read and write it."""
    directory = Path(directory).expanduser().absolute()
    try:
        for sub in ("inductor", "triton"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory / sub):
                pass
            os.listdir(directory / sub)
    except OSError as e:
        logger.warning("compile cache %s cannot be used (%s): compiling without it; give --compile-cache a "
                       "folder this process can create and write", directory, e)
        return None
    _point_caches_at(directory)
    logger.info("compile cache: %s", directory)
    return directory


def use_fresh_compile_cache(broken: Path, error: BaseException) -> Path:
    """After `error` while compiling with the cache in `broken`: a fresh temporary folder,
    removed when the process exits."""
    fresh = Path(tempfile.mkdtemp(prefix="loraswap-compile-cache-"))
    atexit.register(shutil.rmtree, fresh, ignore_errors=True)
    reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:300]
    logger.warning("compiling with the compile cache %s failed (%s: %s); compiling cold in %s instead. "
                   "Delete %s to rebuild it", broken, type(error).__name__, reason, fresh, broken)
    _point_caches_at(fresh)
    _clear_inductor_memory()
    return fresh


def lookup_counts() -> dict[str, dict[str, int]]:
    """torch's cache lookup counters of this process: {"fxgraph": {"hit", "miss", "bypass"}, "aotautograd": ...}."""
    return {cache: {result: counters[group][prefix + result] for result in RESULTS}
            for cache, (group, prefix) in LOOKUPS.items()}


def lookups_since(before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    now = lookup_counts()
    return {cache: {result: now[cache][result] - before[cache][result] for result in RESULTS} for cache in now}


def format_lookups(lookups: dict[str, dict[str, int]]) -> str:
    """`fxgraph 2 hit 0 miss 0 bypass, aotautograd ...`."""
    return ", ".join(f"{cache} " + " ".join(f"{n} {result}" for result, n in results.items())
                     for cache, results in lookups.items())


def _point_caches_at(directory: Path) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    if getattr(getattr(torch.compiler, "config", None), "force_disable_caches", False):
        logger.warning("torch's caches are disabled (TORCHINDUCTOR_FORCE_DISABLE_CACHES): the compile cache "
                       "%s will be neither read nor written", directory)


def _clear_inductor_memory() -> None:
    """Forget what Inductor loaded from the old folder (its in-memory caches; named
    `clear_caches` in recent torch, `clear_inductor_caches` before)."""
    import torch._inductor.utils as inductor_utils

    clear = getattr(inductor_utils, "clear_caches", None) or getattr(inductor_utils, "clear_inductor_caches", None)
    if clear is not None:
        clear()
