"""Bringing one model up: load, quantize, compile, warm up; a cold retry when the compile
cache breaks the first compile; the start-up figures.

`Startup` does it for the engine, which hands it the parts it needs (the pipeline it
loaded, the swapper, a way to make the warm-up images), and keeps what the server reports
of it: seconds by phase (`figures`: load_s, warmup_s, first_image_s, and prewarm_s with
`--compile-while-loading`) and torch's compile cache lookups until the first image. Once
the first image is made, the start-up is out of the request path.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from loraswap.engine.calls import Stopped
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.process import cap_gpu_memory, pin_by_registering, release_memory
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
        if config.memory.max_gpu_memory_gb and device.type == "cuda":
            cap_gpu_memory(device, config.memory.max_gpu_memory_gb)
        if device.type == "cuda":
            pin_by_registering()
        # set before anything compiles (the denoiser, the swap kernel); the UNets' SDPA kernel
        # choice is made outside the graph, so it goes into the cache key
        if hasattr(torch.compiler.config, "cache_key_tag"):
            torch.compiler.config.cache_key_tag = f"attention={config.compilation.attention or 'default'}"
        cache_dir = config.compilation.compile_cache
        self.compile_cache = use_compile_cache(cache_dir) if cache_dir else None
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
        quantization = config.quantization
        quantizing = device.type == "cuda" and {quantization.quantize, quantization.quantize_text_encoders} != {"none"}
        via_host = quantizing and (config.memory.max_gpu_memory_gb is not None
                                   or torch.cuda.get_device_properties(device).total_memory < ROOMY_GPU_BYTES)
        pipeline = self._load(torch.device("cpu") if via_host else device, staged_ok=not via_host)
        if quantizing:
            logger.info("loaded %s on %s in %.1f s; quantizing", config.model, "the host" if via_host else "the GPU",
                        time.perf_counter() - self.started)
        for name in denoiser_names(pipeline):
            quantize_module(getattr(pipeline, name), quantization.quantize, device)
        quantize_text_encoders(pipeline, quantization.quantize_text_encoders, device)
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
        compilation = config.compilation
        wanted = (staged_ok and compilation.compile_while_loading and self.compiled and Path(config.model).is_dir()
                  and compilation.compile_mode not in CUDA_GRAPH_MODES)
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
            release_memory(device)
            return None
        failed = self._fill_beside_prewarm(plan, self._start_prewarm(denoiser, device))
        if failed is None:
            return pipeline
        logger.warning("copying %s's weights failed (%s); loading through from_pretrained", self.config.model, failed)
        del pipeline, plan
        release_memory(device)
        return None

    def _start_prewarm(self, denoiser, device: torch.device) -> Prewarm | None:
        config = self.config
        try:
            return Prewarm(denoiser, device=device, dtype=self.dtype, quantize=config.quantization.quantize,
                           compile_mode=config.compilation.compile_mode, attention=config.compilation.attention)
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
            compilation = config.compilation
            compile_pipeline(pipeline, compilation.compile_mode,
                             wants_compiled_vae(compilation.compile_vae, compilation.compile_mode))
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
        return self.compiled and any(compiles_whole(d, self.config.compilation.compile_mode) for d in denoisers)

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
