"""The engine: one warm base model, its fused swapper, its adapter cache and prefetcher.

Public surface: `Engine(config)`, `generate(request)`, `generate_batch(requests)`,
`prefetch(loras)`, `resolve_adapter(id)`, `set_adapters(loras)`, `recompiles`. The
pipeline and the weights are driven by exactly one thread (the server's GPU worker, or
the CLI); adapter reading and the host-to-GPU copies of prefetch run on a thread pool.
"""

import contextlib
import functools
import gc
import inspect
import logging
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch._dynamo.utils import counters

from ..adapters.cache import AdapterCache, CacheEntry
from ..adapters.formats import load_adapter
from ..adapters.metadata import refuse_other_base
from ..adapters.source import AdapterSources, HubAdapterSource, LocalAdapterSource, check_adapter_id
from ..errors import AdapterNotFound, BadRequest
from ..models import generation_defaults, load_pipeline, model_name, resolve_device
from ..models.staged import build_pipeline, fill_pipeline, plan_fill
from .attention import AttentionBackend
from .baseline import DiffusersLoadFuse
from .compile_cache import format_lookups, lookup_counts, lookups_since, use_compile_cache, use_fresh_compile_cache
from .config import EngineConfig, GenerateRequest
from .prewarm import Prewarm, denoiser_config
from .quantize import quantize_module, quantize_text_encoders
from .swap import BoundAdapter, FusedSwapper

logger = logging.getLogger(__name__)

T = TypeVar("T")
Acquired = list[tuple[CacheEntry, float]]  # adapters held in the cache for one request, with weights


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs
ROOMY_GPU_BYTES = 64 * 2**30  # a GPU this large loads a model to quantize in full precision first


@dataclass
class GenerateResult:
    image: Image.Image
    seed: int
    swap_seconds: float  # 0 when the wanted adapters were already applied
    generate_seconds: float


def on_device(device: torch.device):
    """`device` made the thread's current CUDA device for the block: Triton's launches (the
    swap kernels), `current_stream()` and `synchronize()` go to the current device, not the
    tensors' (`--device cuda:1` from a thread whose current device is 0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_its_device(method):
    """An Engine method run with the engine's device current (`on_device`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with on_device(self.device):
            return method(self, *args, **kwargs)
    return run


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = config.torch_dtype(self.device)
        started = time.perf_counter()
        logger.info("loading %s on %s (%s)", config.model, self.device, self.dtype)
        if config.max_gpu_memory_gb and self.device.type == "cuda":
            cap_gpu_memory(self.device, config.max_gpu_memory_gb)
        # a model to quantize loads onto a GPU with room for it in full precision and is
        # quantized in place there (fast); under --max-gpu-memory-gb or on a smaller GPU it is
        # built on the host and quantized layer by layer onto the GPU, so the full-precision
        # model never has to fit there
        quantizing = self.device.type == "cuda" and (config.quantize, config.quantize_text_encoders) != ("none", "none")
        via_host = quantizing and (config.max_gpu_memory_gb is not None
                                   or torch.cuda.get_device_properties(self.device).total_memory < ROOMY_GPU_BYTES)
        self.compiled = config.compile if config.compile is not None else self.device.type == "cuda"
        if config.swap_mode == "diffusers" and self.compiled:
            logger.info("--swap-mode diffusers runs eager, as seed 1 did: not compiling")
            self.compiled = False
        # the compile cache is set before anything compiles (the denoiser, the swap kernel); the
        # UNets' SDPA kernel choice is made outside the graph, so it goes into the cache key
        if hasattr(torch.compiler.config, "cache_key_tag"):
            torch.compiler.config.cache_key_tag = f"attention={config.attention or 'default'}"
        self.compile_cache = use_compile_cache(config.compile_cache) if config.compile_cache else None
        self._lookups_before = lookup_counts()
        # seconds from the start: load (the pipeline on the device), warmup (compile + warm-up image),
        # first_image (start to the first image made, the warm-up's or, without warm-up, a request's);
        # prewarm_s: how long the stand-in's thread ran, within the load (--compile-while-loading)
        self.startup: dict[str, float] = {}
        self.pipeline = self._load(config, via_host)
        if quantizing:
            logger.info("loaded %s on %s in %.1f s; quantizing", config.model, "the host" if via_host else "the GPU",
                        time.perf_counter() - started)
        quantize_module(self.denoiser, config.quantize, self.device)
        quantize_text_encoders(self.pipeline, config.quantize_text_encoders, self.device)
        if via_host:
            self.pipeline.to(self.device)
        self.startup["load_s"] = time.perf_counter() - started
        self.model_name = model_name(self.pipeline, config.model)
        self.components = {name: getattr(self.pipeline, name) for name in self.pipeline._lora_loadable_modules
                           if getattr(self.pipeline, name, None) is not None}
        self.unet_config = self.components["unet"].config if "unet" in self.components else None
        self.swapper = FusedSwapper(self.components, pristine=config.pristine, max_rank=config.max_rank)
        if config.pristine == "host":  # pinned at start-up, not in the first requests' swaps
            pinning = time.perf_counter()
            self.swapper.save_all_pristine()
            logger.info("pristine copies in host RAM: %.2f GiB in %.1f s", self.swapper.pristine_bytes / 2**30,
                        time.perf_counter() - pinning)
        self.source = config.source or self._sources(config)
        self.cache = AdapterCache(config.cache, self.device)
        self._prefetcher = ThreadPoolExecutor(config.prefetch_threads, thread_name_prefix="loraswap-prefetch")
        self._applied: list[tuple[CacheEntry, float]] = []  # the cache entries fused now
        self._call_parameters = set(inspect.signature(self.pipeline.__call__).parameters)
        # pipelines that postprocess with diffusers' VaeImageProcessor (SD, SDXL, FLUX.1) return
        # "pt" images as (batch, channels, height, width) in [0, 1]; others keep their PIL output
        self._images_on_device = "output_type" in self._call_parameters and isinstance(
            getattr(self.pipeline, "image_processor", None), VaeImageProcessor)
        self.defaults = generation_defaults(config.model)
        self.baseline = DiffusersLoadFuse(self.pipeline) if config.swap_mode == "diffusers" else None
        self.attention = AttentionBackend(config.attention, self.components) if config.attention else None
        self.compile_cache_lookups: dict[str, dict[str, int]] | None = None  # torch's, until the first image
        self._started, self._retried_cold = started, False
        warming = time.perf_counter()
        if self.compiled:
            self._compile()
        if config.warmup:
            logger.info("warming up%s", " (compiling)" if self.compiled else "")
            if self.baseline is None:  # seed-1 mode swaps through diffusers, not the kernels
                kernels = time.perf_counter()
                with on_device(self.device):
                    self._maybe_retry_cold(self.swapper.warm_up_kernel)
                logger.info("swap kernels ready in %.2f s", time.perf_counter() - kernels)
            self.generate(GenerateRequest(prompt="warm-up", seed=0, steps=2))
            self.startup["warmup_s"] = time.perf_counter() - warming
        self._graphs_after_warmup = self._graph_count()
        logger.info("%s ready in %.1f s", self.model_name, time.perf_counter() - started)

    # ---------------------------------------------------------------- adapters
    @staticmethod
    def _sources(config: EngineConfig) -> AdapterSources | None:
        local = LocalAdapterSource(config.adapters) if config.adapters else None
        hub = HubAdapterSource(config.hub_cache_dir, tuple(config.hub_allow), tuple(config.hub_deny),
                               int(config.max_adapter_mb * 2**20)) if config.hub else None
        return AdapterSources(local, hub) if local or hub else None

    def locate(self, adapter_id: str):
        """The adapter's file (404/400 for unknown or bad ids), without reading it."""
        check_adapter_id(adapter_id)
        if self.source is None:
            raise AdapterNotFound(adapter_id, "this server was started without an adapter folder",
                                  "Start it with --adapters DIR")
        return self.source.locate(adapter_id)

    def acquire_adapter(self, adapter_id: str) -> CacheEntry:
        """The adapter ready to fuse, held in the cache until `release_adapters`.

        From the cache when the file is unchanged (size, mtime, ctime, inode), else read, converted,
        checked against this model and packed into host RAM (pinned later by the cache, off
        the request's path); then copied to the GPU tier when its budget allows.
        """
        location = self.locate(adapter_id)
        stat = location.weights.stat()
        # ctime and inode too: a copy that keeps the mtime (cp -p, rsync -t, tar) is still a new file
        stamp = (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
        entry = self.cache.lookup(adapter_id, stamp)
        if entry is None:
            parsed = load_adapter(location, type(self.pipeline), self.swapper.component_modules,
                                  int(self.config.max_adapter_mb * 2**20), self.unet_config)
            refuse_other_base(adapter_id, parsed.base_models, [self.model_name])
            bound = self.swapper.bind(parsed, base_models=parsed.base_models, dtype=self.dtype)
            entry = self.cache.insert(adapter_id, bound, stamp)
        try:
            self.cache.maybe_copy_to_gpu(entry)
        except BaseException:
            self.cache.release(entry)  # (held by the lookup or insert above)
            raise
        return entry

    def acquire_adapters(self, loras: list[tuple[str, float]]) -> Acquired:
        self._check_blend(loras)
        acquired: Acquired = []
        try:
            for adapter_id, weight in loras:
                acquired.append((self.acquire_adapter(adapter_id), float(weight)))
        except BaseException:
            self.release_adapters(acquired)
            raise
        return acquired

    def release_adapters(self, acquired: Acquired) -> None:
        for entry, _ in acquired:
            self.cache.release(entry)

    def prefetch(self, loras: list[tuple[str, float]]) -> Future:
        """Start reading the adapters now (thread pool); the future holds them acquired."""
        if self.baseline is not None or not loras:
            done = Future()
            done.set_result([])
            return done
        return self._prefetcher.submit(self.acquire_adapters, loras)

    def resolve_adapter(self, adapter_id: str) -> BoundAdapter:
        """The adapter checked against this model (host tier), e.g. for inspection."""
        entry = self.acquire_adapter(adapter_id)
        self.cache.release(entry)
        return entry.host

    def pin_adapter(self, adapter_id: str) -> BoundAdapter:
        """Load the adapter into the cache now and keep it there until `unpin_adapter`."""
        entry = self.acquire_adapter(adapter_id)
        self.cache.pin(adapter_id)
        self.cache.release(entry)
        return entry.host

    def unpin_adapter(self, adapter_id: str) -> None:
        """Unpin and evict the adapter (it is read from disk when next used)."""
        self.locate(adapter_id)
        self.cache.unpin(adapter_id)

    def list_adapters(self) -> list[dict]:
        """Every adapter in the folder: id, where it is cached, and what is known of it."""
        if self.source is None:
            return []
        applied = {aid for aid, _ in self.applied_ids}
        rows = []
        for adapter_id in self.source.list_ids():
            entry = self.cache.get(adapter_id)
            row = {"id": adapter_id, "cached": entry.tier.value if entry else "disk",
                   "pinned": bool(entry and entry.pinned), "applied": adapter_id in applied}
            if entry is not None:
                bound = entry.host
                row.update(base_model=bound.base_models[0] if bound.base_models else self.model_name,
                           rank=max(layer.rank for layer in bound.layers.values()), bytes=bound.nbytes,
                           layers=len(bound.layers))
            rows.append(row)
        return rows

    def _check_blend(self, loras: list[tuple[str, float]]) -> None:
        if len(loras) > self.config.max_blend:
            raise BadRequest(f"{len(loras)} adapters requested; at most {self.config.max_blend} can be blended")
        if len({aid for aid, _ in loras}) != len(loras):
            raise BadRequest("the same adapter is named twice; give it one weight")

    @property
    def applied_ids(self) -> tuple[tuple[str, float], ...]:
        if self.baseline is not None:
            return self.baseline.applied_ids
        return tuple((entry.adapter_id, weight) for entry, weight in self._applied)

    @_on_its_device
    def set_adapters(self, loras: list[tuple[str, float]], acquired: Acquired | None = None) -> float:
        """Apply exactly these adapters (id, weight); seconds spent swapping (0 if already so).

        `acquired`: the adapters already held (from `prefetch`); the caller releases them.
        """
        if self.baseline is not None:
            self._check_blend(loras)
            if self.baseline.applied_ids == tuple(loras):
                return 0.0
            return self.baseline.apply([(self.locate(aid), float(weight)) for aid, weight in loras])
        own = acquired is None
        acquired = self.acquire_adapters(loras) if own else acquired
        try:
            wanted = list(acquired)
            if len(wanted) == len(self._applied) and all(
                    a is b and wa == wb for (a, wa), (b, wb) in zip(wanted, self._applied)):
                return 0.0  # same cache entries: a file changed on disk is re-read into a new entry
            seconds = self.swapper.apply([(entry.best(), weight) for entry, weight in acquired])
            self._applied = wanted
        except BaseException:
            self._applied = []
            raise
        finally:
            if own:
                self.release_adapters(acquired)
        logger.debug("swap to %s in %.1f ms", loras or "base", seconds * 1e3)
        return seconds

    # ---------------------------------------------------------------- generation
    def generate(self, request: GenerateRequest, acquired: Acquired | None = None) -> GenerateResult:
        return self.generate_batch([request], acquired)[0]

    @_on_its_device
    def generate_batch(self, requests: list[GenerateRequest], acquired: Acquired | None = None) \
            -> list[GenerateResult]:
        """Images for requests sharing adapters and parameters, in one pipeline call.

        Each image has its own prompt and seed (a generator per image), so it is the image
        the request would get alone, up to the numerics of a larger batch.
        """
        first = requests[0]
        # 1. put the requested adapters on the model (validated before anything changes)
        swap_seconds = self.set_adapters(first.loras, acquired)
        # 2. build the pipeline call; seeds drive CPU generators, as the HF image does
        seeds = [r.seed if r.seed is not None else random.randrange(2**31) for r in requests]
        kwargs = dict(prompt=[r.prompt for r in requests])
        if self._images_on_device:
            kwargs["output_type"] = "pt"  # made 8-bit on the device (`to_pil`), not as floats on the host
        defaults = self.defaults
        optional = dict(guidance_scale=first.guidance, num_inference_steps=first.steps or defaults.get("steps"),
                        width=first.width or defaults.get("width"), height=first.height or defaults.get("height"))
        if any(r.negative_prompt for r in requests):
            optional["negative_prompt"] = [r.negative_prompt or "" for r in requests]
        kwargs.update({k: v for k, v in optional.items() if v is not None and k in self._call_parameters})
        # 3. generate (generators made per attempt: a call retried cold starts from the seeds again)
        def generators() -> list[torch.Generator]:
            return [torch.Generator("cpu").manual_seed(seed) for seed in seeds]

        started = time.perf_counter()
        with torch.inference_mode(), self.attention.context() if self.attention else contextlib.nullcontext():
            images = self._maybe_retry_cold(lambda: self.pipeline(**kwargs, generator=generators()).images)
        if self._images_on_device:
            images = to_pil(images)
        seconds = time.perf_counter() - started
        if "first_image_s" not in self.startup:
            self._record_first_image()
        return [GenerateResult(image, seed, swap_seconds, seconds) for image, seed in zip(images, seeds)]

    # ---------------------------------------------------------------- compilation and start-up
    def _maybe_retry_cold(self, step: Callable[[], T]) -> T:
        """`step()`; until the first image, one that fails with a compile cache in use is
        retried once, compiling cold in a fresh folder (the cache's folder is left as it is)."""
        if self.compile_cache is None or self._retried_cold or "first_image_s" in self.startup:
            return step()
        try:
            return step()
        except Exception as e:
            self._retried_cold = True
            self.compile_cache = use_fresh_compile_cache(self.compile_cache, e)
            self._lookups_before = lookup_counts()
            return step()

    def _record_first_image(self) -> None:
        self.startup["first_image_s"] = time.perf_counter() - self._started
        self.compile_cache_lookups = lookups_since(self._lookups_before)
        logger.info("%s: first image %.1f s after start (load %.1f s); compile cache %s: %s", self.model_name,
                    self.startup["first_image_s"], self.startup["load_s"], self.compile_cache or "off",
                    format_lookups(self.compile_cache_lookups))

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, "transformer", None) or self.pipeline.unet

    def _load(self, config: EngineConfig, via_host: bool):
        """The pipeline (`models.load_pipeline`). With `--compile-while-loading`, a local
        diffusers folder whose denoiser has a stand-in (FLUX.1) and regional compile, in two
        stages instead (`models/staged.py`): every module built and every file checked, then
        the stand-in compiled on a thread (`engine/prewarm.py`) beside the weights' copy only,
        and joined before anything else runs. A folder the stages refuse, or a copy that fails,
        goes through `from_pretrained`, never beside the thread."""
        device = torch.device("cpu") if via_host else self.device
        wanted = (config.compile_while_loading and self.compiled and not via_host and Path(config.model).is_dir()
                  and config.compile_mode not in CUDA_GRAPH_MODES)
        staged = self._load_staged(config, device) if wanted else None
        return staged if staged is not None else load_pipeline(config.model, device=device, dtype=self.dtype)

    def _load_staged(self, config: EngineConfig, device: torch.device):
        """The staged load with its stand-in (`_load`); None, every staged module freed, when
        the folder must go through `from_pretrained`."""
        pipeline = plan = None
        try:
            denoiser = denoiser_config(config.model)
            if not Prewarm.applies(denoiser):
                return None
            pipeline = build_pipeline(config.model, device, self.dtype)
            plan = plan_fill(pipeline, config.model)
        except Exception as e:  # Unsupported, or anything the folder holds that the stages do not expect
            logger.info("loading %s through from_pretrained (%s: %s)", config.model, type(e).__name__, e)
        if plan is None:  # out of the except clause: the exception's frames no longer hold the modules
            del pipeline
            _release_memory(device)
            return None
        try:
            prewarm = Prewarm(denoiser, device=device, dtype=self.dtype, quantize=config.quantize,
                              compile_mode=config.compile_mode, attention=config.attention)
        except Exception as e:  # no room for the stand-in, say: the warm-up compiles
            logger.warning("no stand-in to compile while loading (%s: %s)", type(e).__name__, e)
            prewarm = None
        failed, copying = None, time.perf_counter()
        try:
            fill_pipeline(plan)
            logger.info("copied %s's weights in %.1f s", config.model, time.perf_counter() - copying)
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"  # not the exception: its frames would keep the modules
        finally:
            seconds = prewarm.join() if prewarm is not None else None
        if failed is None:
            if seconds is not None:
                self.startup["prewarm_s"] = seconds
            return pipeline
        logger.warning("copying %s's weights failed (%s); loading through from_pretrained", config.model, failed)
        del pipeline, plan
        _release_memory(device)
        return None

    def _compile(self) -> None:
        compile_denoiser(self.denoiser, self.config.compile_mode)
        vae = getattr(self.pipeline, "vae", None)
        if self.compile_vae and vae is not None and hasattr(vae, "decoder"):
            # CUDA graphs would hold the decoder's large activations in their own pool: default mode
            vae.decoder.compile()

    @property
    def compile_vae(self) -> bool:
        """Whether the VAE decoder is compiled with the denoiser. By default only with the
        CUDA-graph modes: a 1024x1024 decode is 86 ms eager and 35 ms compiled on an H200,
        a twentieth of an SDXL request but under 2 % of a FLUX.1 image, whose restart it
        would lengthen by about 3 s (18 s for a cold start)."""
        if self.config.compile_vae is not None:
            return self.config.compile_vae
        return self.config.compile_mode in CUDA_GRAPH_MODES

    @staticmethod
    def _graph_count() -> int:
        return counters["stats"]["unique_graphs"]

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up: a swap must never add one."""
        return self._graph_count() - self._graphs_after_warmup


def _release_memory(device: torch.device) -> None:
    """Give back what dropped modules held before a second load takes their place."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """A pipeline's `output_type="pt"` images (batch, channels, height, width; in [0, 1]) as
    PIL images, bitwise the pixels diffusers' own "pil" output gives (float32, times 255,
    rounded half to even), computed where the images are: 1 byte per pixel and channel
    crosses to the host instead of floats converted there (16 ms of a 1024x1024 SDXL request)."""
    pixels = (images.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()
    return [Image.fromarray(p.squeeze(-1) if p.shape[-1] == 1 else p) for p in pixels]


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """`--max-gpu-memory-gb`: hold this process to that much of the GPU (a 24 GB card on a
    larger one); torch's allocator refuses beyond it as it would on the smaller card.

    Under a cap the allocator also grows expandable segments (unless PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF already say): fixed segments left 2.2 GiB reserved but unused
    at the 24 GB mode's peak, memory the small card does not have. Set before the first
    CUDA allocation, so every segment is expandable."""
    if use_expandable_segments():
        logger.info("GPU memory in expandable segments (less reserved beyond what is allocated)")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gigabytes * 2**30 / total), index)
    logger.info("GPU %d capped at %.1f GiB of %.1f GiB", index, min(gigabytes, total / 2**30), total / 2**30)


def use_expandable_segments() -> bool:
    """Switch torch's CUDA allocator to expandable segments unless its settings name them
    already (the operator's choice stands); whether it was switched."""
    configured = ",".join(os.environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))
    if "expandable_segments" in configured:
        return False
    # torch 2.9+ names it in torch._C; torch.cuda.memory's older name warns that it is deprecated
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
        or torch.cuda.memory._set_allocator_settings
    set_settings("expandable_segments:True")
    return True


def compile_denoiser(denoiser: torch.nn.Module, mode: str = "default") -> None:
    """Regional compile (the repeated blocks, compiled once and reused) by default; the
    CUDA-graph modes compile the whole denoiser, whose launches they exist to remove.
    Swaps write weights in place, so compiled code and recorded graphs stay valid."""
    options = {} if mode == "default" else {"mode": mode}
    cuda_graphs = mode in CUDA_GRAPH_MODES
    if not cuda_graphs and getattr(denoiser, "_repeated_blocks", None):
        denoiser.compile_repeated_blocks(fullgraph=True, **options)
    else:
        denoiser.compile(fullgraph=False, **options)
