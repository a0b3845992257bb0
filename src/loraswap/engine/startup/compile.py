"""Compiling the denoiser: regional compile or the CUDA-graph modes, and the persistent
compile cache.

Regional compile (the repeated blocks, compiled once and reused) is the default; the
CUDA-graph modes compile the whole denoiser, whose launches they exist to remove. Swaps
write weights in place, so compiled code and recorded graphs stay valid; `graph_count`
lets the engine check that no swap ever adds a graph.

The warm-up compiles FLUX.1's single-stream block twice, and that is not a fault: the
first single block takes the double blocks' contiguous output, every later one a slice
of its predecessor's output (`hidden_states[:, text_len:]`), whose batch stride differs.
Dynamo guards on strides, so the two layouts get a graph each. A contiguous copy per
block would cost memory traffic on every step, and re-viewing the slice with contiguous
strides inside the compiled block is refused by dynamo (as_strided of a graph output).

The persistent compile cache keeps torch.compile's on-disk caches in a folder that
outlives the process. `use_compile_cache(DIR)` points them at DIR before the engine compiles anything:

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

from loraswap.models import denoiser_names

logger = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs

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


def compile_denoiser(denoiser: torch.nn.Module, mode: str = "default") -> None:
    """Regional compile by default; the whole denoiser in the CUDA-graph modes, or when it
    names no repeated blocks (SD 3's transformer, the UNets)."""
    options = {} if mode == "default" else {"mode": mode}
    if compiles_whole(denoiser, mode):
        denoiser.compile(fullgraph=False, **options)
    else:
        compile_blocks(denoiser, **options)


def compiles_whole(denoiser: torch.nn.Module, mode: str) -> bool:
    """Whether `compile_denoiser` compiles `denoiser` whole (hooks put on its blocks later
    would be traced into its graph), not block by block."""
    return mode in CUDA_GRAPH_MODES or not getattr(denoiser, "_repeated_blocks", None)


def compile_blocks(denoiser: torch.nn.Module, **options) -> None:
    """Regional compile, as diffusers' `compile_repeated_blocks`, but of each block's forward
    rather than its whole call: hooks put on a block later (the step caches', which decide
    in Python whether the block runs) wrap the compiled forward instead of being traced into
    it, so a cache on or off compiles nothing new. The blocks of a class share their graphs
    (one code object, the parameters graph inputs), as with `compile_repeated_blocks`."""
    names = set(denoiser._repeated_blocks)
    blocks = [module for module in denoiser.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(denoiser).__name__} has none of its repeated blocks {sorted(names)}")
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=True, **options)


def compile_pipeline(pipeline, mode: str, compile_vae: bool) -> None:
    """The denoisers (Wan 2.2 has two), and the VAE decoder when asked (`CompilationConfig.compile_vae`)."""
    for name in denoiser_names(pipeline):
        compile_denoiser(getattr(pipeline, name), mode)
    vae = getattr(pipeline, "vae", None)
    if compile_vae and vae is not None and hasattr(vae, "decoder"):
        # CUDA graphs would hold the decoder's large activations in their own pool: default mode
        vae.decoder.compile()


def wants_compiled_vae(setting: bool | None, mode: str) -> bool:
    """Whether the VAE decoder is compiled with the denoiser: as set, else with the
    CUDA-graph modes only. Their requests are short, so the decode counts; with regional
    compile (long FLUX.1 images) it would cost a restart more than it saves
    (bench/results/runs/2026-12-03-startup-flux-fp8-h200.md)."""
    return setting if setting is not None else mode in CUDA_GRAPH_MODES


def graph_count() -> int:
    """Graphs dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]
