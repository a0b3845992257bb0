"""Bringing one model up: load, quantize, compile, warm up; a cold retry when the compile
cache breaks the first compile; the start-up figures.

`Startup` does it for the engine, which hands it the parts it needs (the pipeline it
loaded, the swapper, a way to make the warm-up images), and keeps what the server reports
of it: seconds by phase (`figures`: load_s, warmup_s, first_image_s, and prewarm_s with
`--compile-while-loading`) and torch's compile cache lookups until the first image. Once
the first image is made, the start-up is out of the request path.
"""

import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from loraswap.engine.calls import Stopped
from loraswap.engine.config import EngineConfig
from loraswap.engine.quantize.weights import quantize_module, quantize_text_encoders
from loraswap.engine.startup.compile import (
    CUDA_GRAPH_MODES,
    compile_pipeline,
    compiles_whole,
    format_lookups,
    lookup_counts,
    lookups_since,
    use_compile_cache,
    use_fresh_compile_cache,
    wants_compiled_vae,
)
from loraswap.engine.startup.prewarm import Prewarm, denoiser_config
from loraswap.models import denoiser_names, load_pipeline
from loraswap.models.staged import build_pipeline, fill_pipeline, plan_fill

logger = logging.getLogger(__name__)

T = TypeVar("T")

ROOMY_GPU_BYTES = 64 * 2**30  # a GPU this large loads a model to quantize in full precision first


class Startup:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, compiled: bool):
        self.config, self.device, self.dtype, self.compiled = config, device, dtype, compiled
        self.started = time.perf_counter()
        self.figures: dict[str, float] = {}  # seconds from the start, by phase
        self.compile_cache_lookups: dict[str, dict[str, int]] | None = None  # torch's, until the first image
        self._retried_cold = False
        if config.max_gpu_memory_gb and device.type == "cuda":
            cap_gpu_memory(device, config.max_gpu_memory_gb)
        if device.type == "cuda":
            pin_by_registering()
        # set before anything compiles (the denoiser, the swap kernel); the UNets' SDPA kernel
        # choice is made outside the graph, so it goes into the cache key
        if hasattr(torch.compiler.config, "cache_key_tag"):
            torch.compiler.config.cache_key_tag = f"attention={config.attention or 'default'}"
        self.compile_cache = use_compile_cache(config.compile_cache) if config.compile_cache else None
        self._lookups_before = lookup_counts()

    # ---------------------------------------------------------------- load
    def load(self):
        """The pipeline on the device, quantized as configured.

        A model to quantize loads onto a GPU with room for it in full precision and is
        quantized in place there (fast); under --max-gpu-memory-gb or on a smaller GPU it is
        built on the host and quantized layer by layer onto the GPU, so the full-precision
        model never has to fit there."""
        config, device = self.config, self.device
        logger.info("loading %s on %s (%s)", config.model, device, self.dtype)
        quantizing = device.type == "cuda" and (config.quantize, config.quantize_text_encoders) != ("none", "none")
        via_host = quantizing and (config.max_gpu_memory_gb is not None
                                   or torch.cuda.get_device_properties(device).total_memory < ROOMY_GPU_BYTES)
        pipeline = self._load(torch.device("cpu") if via_host else device, staged_ok=not via_host)
        if quantizing:
            logger.info("loaded %s on %s in %.1f s; quantizing", config.model, "the host" if via_host else "the GPU",
                        time.perf_counter() - self.started)
        for name in denoiser_names(pipeline):
            quantize_module(getattr(pipeline, name), config.quantize, device)
        quantize_text_encoders(pipeline, config.quantize_text_encoders, device)
        if via_host:
            pipeline.to(device)
        self.figures["load_s"] = time.perf_counter() - self.started
        return pipeline

    def _load(self, device: torch.device, staged_ok: bool):
        """`models.load_pipeline`; or, with `--compile-while-loading`, for a local diffusers
        folder whose denoiser has a stand-in (FLUX.1) and regional compile, two stages: every
        module built and every file checked, then the stand-in compiled on a thread
        (`prewarm.py`) beside the weights' copy only. A folder the stages refuse, or a copy
        that fails, goes through `from_pretrained`, never beside the thread."""
        config = self.config
        wanted = (staged_ok and config.compile_while_loading and self.compiled and Path(config.model).is_dir()
                  and config.compile_mode not in CUDA_GRAPH_MODES)
        staged = self._load_staged(device) if wanted else None
        return staged if staged is not None else load_pipeline(config.model, device=device, dtype=self.dtype)

    def _load_staged(self, device: torch.device):
        """The staged load with its stand-in; None, every staged module freed, when the
        folder must go through `from_pretrained`."""
        pipeline = plan = None
        try:
            denoiser = denoiser_config(self.config.model)
            if not Prewarm.applies(denoiser):
                return None
            pipeline = build_pipeline(self.config.model, device, self.dtype)
            plan = plan_fill(pipeline, self.config.model)
        except Exception as e:  # Unsupported, or anything the folder holds that the stages do not expect
            logger.info("loading %s through from_pretrained (%s: %s)", self.config.model, type(e).__name__, e)
        if plan is None:  # out of the except clause: the exception's frames no longer hold the modules
            del pipeline
            _release_memory(device)
            return None
        failed = self._fill_beside_prewarm(plan, self._start_prewarm(denoiser, device))
        if failed is None:
            return pipeline
        logger.warning("copying %s's weights failed (%s); loading through from_pretrained", self.config.model, failed)
        del pipeline, plan
        _release_memory(device)
        return None

    def _start_prewarm(self, denoiser, device: torch.device) -> Prewarm | None:
        config = self.config
        try:
            return Prewarm(denoiser, device=device, dtype=self.dtype, quantize=config.quantize,
                           compile_mode=config.compile_mode, attention=config.attention)
        except Exception as e:  # no room for the stand-in, say: the warm-up compiles
            logger.warning("no stand-in to compile while loading (%s: %s)", type(e).__name__, e)
            return None

    def _fill_beside_prewarm(self, plan, prewarm: Prewarm | None) -> str | None:
        """Copy the weights in while the stand-in compiles; what failed, or None."""
        failed, copying = None, time.perf_counter()
        try:
            fill_pipeline(plan)
            logger.info("copied %s's weights in %.1f s", self.config.model, time.perf_counter() - copying)
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"  # not the exception: its frames would keep the modules
        finally:
            seconds = prewarm.join() if prewarm is not None else None
        if failed is None and seconds is not None:
            self.figures["prewarm_s"] = seconds
        return failed

    # ---------------------------------------------------------------- compile and warm up
    def compile_and_warm_up(self, pipeline, swapper, warm_up_images: Callable[[], object]) -> None:
        """Compile the pipeline (after `swapper` has set up what the graphs must see), warm the
        swapper's kernels, then `warm_up_images()`: the warm-up images, which compile."""
        config = self.config
        warming = time.perf_counter()
        if self.compiled:
            swapper.prepare_to_compile()
            compile_pipeline(pipeline, config.compile_mode, wants_compiled_vae(config.compile_vae,
                                                                                config.compile_mode))
        if not config.warmup:
            return
        logger.info("warming up%s", " (compiling)" if self.compiled else "")
        kernels = time.perf_counter()
        if self.retry_cold(swapper.warm_up):
            logger.info("swap kernels ready in %.2f s", time.perf_counter() - kernels)
        warm_up_images()
        self.figures["warmup_s"] = time.perf_counter() - warming

    def compiles_whole(self, denoisers) -> bool:
        """Whether any of `denoisers` is compiled whole (`compile.compiles_whole`), not block by block."""
        return self.compiled and any(compiles_whole(d, self.config.compile_mode) for d in denoisers)

    @property
    def first_image_done(self) -> bool:
        return "first_image_s" in self.figures

    def first_image(self, call: Callable[[], T], model_name: str, retry: bool = True) -> T:
        """`call()` making the model's first image (a warm-up's, or the first request's): retried
        cold if the compile cache breaks it (unless not to `retry`); the start-up's figures then taken."""
        output = self.retry_cold(call) if retry else call()
        self.figures["first_image_s"] = time.perf_counter() - self.started
        self.compile_cache_lookups = lookups_since(self._lookups_before)
        logger.info("%s: first image %.1f s after start (load %.1f s); compile cache %s: %s", model_name,
                    self.figures["first_image_s"], self.figures["load_s"], self.compile_cache or "off",
                    format_lookups(self.compile_cache_lookups))
        return output

    def retry_cold(self, step: Callable[[], T]) -> T:
        """`step()`; until the first image, one that fails with a compile cache in use is
        retried once, compiling cold in a fresh folder (the cache's folder is left as it is)."""
        if self.compile_cache is None or self._retried_cold or self.first_image_done:
            return step()
        try:
            return step()
        except Stopped:  # its requests were cancelled: the cache is not to blame
            raise
        except Exception as e:
            self._retried_cold = True
            self.compile_cache = use_fresh_compile_cache(self.compile_cache, e)
            self._lookups_before = lookup_counts()
            return step()


def _release_memory(device: torch.device) -> None:
    """Give back what dropped modules held before a second load takes their place."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """`--max-gpu-memory-gb`: hold this process to that much of the GPU (a 24 GB card on a
    larger one); torch's allocator refuses beyond it as it would on the smaller card.

    Under a cap the allocator also grows expandable segments (unless PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF already say): fixed segments leave memory reserved but unused
    at the peak, memory the small card does not have
    (bench/results/runs/2026-12-03-lowmem-flux-h200.md). Set before the first CUDA
    allocation, so every segment is expandable."""
    if use_expandable_segments():
        logger.info("GPU memory in expandable segments (less reserved beyond what is allocated)")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gigabytes * 2**30 / total), index)
    logger.info("GPU %d capped at %.1f GiB of %.1f GiB", index, min(gigabytes, total / 2**30), total / 2**30)


def pin_by_registering() -> bool:
    """Have torch pin host memory as malloc'd pages registered with the driver on several
    threads (`cudaHostRegister`), rather than by `cudaHostAlloc`, unless its settings name
    it already (the operator's choice stands); whether it was switched.

    The adapter cache pins each new adapter's host copy on a background thread. A
    `cudaHostAlloc` of a FLUX.1 rank-64 LoRA's 428 MiB holds the driver, and the GPU worker's
    swap, launching kernels meanwhile, waited it out: 187-206 ms for a cold request's swap
    against 15 ms cached; registered, 15-26 ms (`git show e3c5fe4:scripts/pinning_stall_probe.py`,
    bench/results/runs/2026-12-06-cold-path-h100.md)."""
    if "pinned_use_cuda_host_register" in _operators_settings():
        return False
    threads = 1 << (min(8, os.cpu_count() or 1).bit_length() - 1)  # torch takes a power of two
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    try:
        _set_allocator_settings(setting)
    except (RuntimeError, ValueError) as e:  # a torch that refuses it: pinning still works, by cudaHostAlloc
        logger.warning("could not set %s (%s): pinning a new adapter may stall a swap", setting, e)
        return False
    return True


def use_expandable_segments() -> bool:
    """Switch torch's CUDA allocator to expandable segments unless its settings name them
    already (the operator's choice stands); whether it was switched."""
    if "expandable_segments" in _operators_settings():
        return False
    _set_allocator_settings("expandable_segments:True")
    return True


def _operators_settings() -> str:
    """The allocator settings the environment gives torch (under either of its names)."""
    return ",".join(filter(None, (os.environ.get(name) for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))))


def _set_allocator_settings(setting: str) -> None:
    """Give torch's allocator `setting` after the environment's own: torch's parser resets
    some keys a string leaves out (`max_split_size_mb`, say), so each call restates the
    operator's."""
    torch._C._accelerator_setAllocatorSettings(",".join(filter(None, (_operators_settings(), setting))))


def freeze_loaded_objects() -> None:
    """Take every object alive now (the models' modules and parameters, compiled code, the
    libraries) out of the garbage collector's full collections, which otherwise walk them
    all: on a FLUX.1 server a full collection, set off by the objects cold adapters' reads
    make, took up to 380 ms in the middle of a request's swap
    (bench/results/runs/2026-12-06-cold-path-h100.md). Reference counting still frees them;
    `unfreeze_objects` hands them back. Called once a process has started what it serves."""
    gc.collect()
    gc.freeze()


def unfreeze_objects() -> None:
    """Frozen objects collectable again: a server stopped inside a process that goes on."""
    gc.unfreeze()
