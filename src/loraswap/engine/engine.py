"""The engine: one warm base model, the adapters on it, and the images it makes.

Public surface: `Engine(config)`, `generate_batch(requests, lease)` (its steps:
`prepare_batch`, `apply(lease)`, `run_batch`), `restore_base`, `applied_ids`, `recompiles`,
`adapters` (the `AdapterStore` that locates, reads, caches and keeps this model's adapters),
`keep_adapter` and `evict_adapter` (the store's), `lender` (where leases come from: the
store, or for a baseline its files), `pipeline_arguments(call)`, and for the GPU worker
`stoppable` and `when_lost`. The engine applies what a lease holds; it never takes or gives
back a lease itself, except in `generate` and `set_adapters`, which lease for the call, for
callers on one thread (the CLI, benchmarks, tests). Bringing the model up is
`startup.Startup`'s job; writing adapters into the weights is the swapper's
(`swap.FusedSwapper`, or a baseline of `baselines.py`). The pipeline and the weights are
driven by exactly one thread (the server's GPU worker, or the CLI).

The engine reads the same in one process or many: context parallelism attaches from beside
it (`parallel.ranked.RankedEngine` splits the model in `prepare_model` and keeps its
processes in step around each batch), as step caching and float8 do from their packages.
"""

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from PIL import Image

from loraswap.adapters.bound import BoundAdapter, ModelLayers
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.lease import Lease
from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.adapters.sources.choose import build_sources
from loraswap.adapters.store import AdapterStore, StoreLimits, TargetModel
from loraswap.engine.calls import TEXT, PipelineCalls, Ran
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.previews import LatentPreviews
from loraswap.engine.request import GenerateRequest
from loraswap.engine.sizes import LargestSize
from loraswap.engine.startup.attention import AttentionBackend
from loraswap.engine.startup.bring_up import Startup
from loraswap.engine.startup.compile import graph_count
from loraswap.engine.step_cache import Skips, StepCaching
from loraswap.engine.swap.baselines import HotswapSwapper, LoadAndFuseSwapper
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.errors import LoraswapError
from loraswap.models import (
    adapter_targets,
    denoiser_name,
    denoiser_names,
    family_for,
    generation_defaults,
    model_name,
    resolve_device,
)
from loraswap.models.family import native_size
from loraswap.tracing import adapter_attributes, generation_attributes, traced

logger = logging.getLogger(__name__)

# --swap-mode -> the swapper class; each builds itself for an engine (`for_engine`)
SWAPPERS = {"fused": FusedSwapper, "load-and-fuse": LoadAndFuseSwapper, "hotswap": HotswapSwapper}


@dataclass
class GenerateResult:
    image: Image.Image  # a video's first frame
    seed: int
    swap_seconds: float  # 0 when the wanted adapters were already applied
    generate_seconds: float
    frames: list[Image.Image] | None = None  # a video model's frames, in order
    fps: int | None = None  # the frame rate the video is meant to play at
    # seconds spent before the swap, by phase, filled in by whoever measured it: `read` (waiting
    # for the adapters to be read), `wait` (queued for the GPU worker, the read included), and
    # on Ray `hold` (the replica taking the adapters into its budget) and `ray` (Serve's
    # routing and transport both ways); the server answers them in `Server-Timing`
    timings: dict[str, float] = field(default_factory=dict)
    steps_skipped: int | None = None  # with a step cache: the steps whose blocks a cache stood in for,
    steps_run: int | None = None  # of the steps the pipeline ran
    step_cache: str | None = None  # the step cache setting it ran with (None: none)
    ran: Ran | None = None  # the model, sampler, steps, guidance and adapters it ran with (its record)


@dataclass
class Batch:
    """One pipeline call for requests sharing adapters and parameters, checked and ready to run
    (`Engine.prepare_batch`)."""

    requests: list[GenerateRequest]
    seeds: list[int]  # one per image: its request's, or one drawn for it
    task: str  # which of the model's pipelines takes these inputs (`calls.TEXT`, an edit's, ...)
    pipeline: object  # that pipeline
    kwargs: dict  # its call's arguments, the progress hooks included
    skips: Skips | None  # what the call's step cache skips (None: no step cache)

    def seeded(self) -> list[GenerateRequest]:
        """The requests with the seeds chosen for them: what another process makes the same images from."""
        return [r.model_copy(update={"seed": seed}) for r, seed in zip(self.requests, self.seeds)]


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
    # a running batch may stop at a denoising step (its `on_step` raising `calls.Stopped`)
    stoppable = True
    # a first image that the compile cache breaks is made again, compiling cold
    retries_first_image = True

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = config.torch_dtype(self.device)
        wants_compile = config.compilation.compile if config.compilation.compile is not None \
            else self.device.type == "cuda"
        self.compiled = wants_compile and SWAPPERS[config.swap.swap_mode].compiles
        if wants_compile and not self.compiled:
            logger.info("--swap-mode %s runs eager: not compiling", config.swap.swap_mode)
        self._startup = Startup(config, self.device, self.dtype, self.compiled)
        self.pipeline = self._startup.load()
        self.model_name = model_name(self.pipeline, config.model)
        self.components = adapter_targets(self.pipeline)
        layers = ModelLayers(self.components)  # every layer an adapter may target, walked once
        self.swapper = SWAPPERS[config.swap.swap_mode].for_engine(self.pipeline, layers, config)
        self.adapters = self._make_store(layers)
        self.lender = self.swapper.lender(self.adapters)
        self._applied: list[tuple[object, float]] = []  # what the swapper applied, as leased (on failure: base)
        # the family (None: a pipeline no family lists, served text to image) and its pipelines
        defaults = generation_defaults(config.model)
        largest = LargestSize.of(self.model_name, native_size(self.pipeline, defaults), config.max_size)
        self.calls = PipelineCalls(self.pipeline, family_for(config.model, self.pipeline), defaults, largest)
        # pictures of an image's steps, for the requests that ask (none for a video model)
        self.previews = LatentPreviews(self.pipeline) if getattr(self.pipeline, "vae", None) is not None \
            and not self.calls.is_video else None
        attention = config.compilation.attention
        self.attention = AttentionBackend(attention, self.components) if attention else None
        denoisers = [getattr(self.pipeline, n) for n in denoiser_names(self.pipeline)]
        caching = config.step_caching
        self.step_cache = StepCaching(denoisers, self.model_name, self.device, caching.step_cache,
                                      caching.step_cache_allow, caching.step_cache_calibration,
                                      whole_graph=self._startup.compiles_whole(denoisers))
        self.prepare_model()
        with on_device(self.device):
            self._startup.compile_and_warm_up(self.pipeline, self.swapper, self._warm_up_images)
            self._calibrate_step_cache()
        self._graphs_after_warmup = graph_count()
        logger.info("%s ready in %.1f s", self.model_name, time.perf_counter() - self._startup.started)

    def prepare_model(self) -> None:
        """What changes the model before it is compiled and warmed up: nothing here; a ranked
        engine splits it over its processes."""

    def pipeline_arguments(self, kwargs: dict) -> dict:
        """A pipeline call's arguments in this process: `kwargs` as they are here (a ranked
        engine's second half of --cfg-parallel swaps the prompts)."""
        return kwargs

    def when_lost(self, answer: Callable[[LoraswapError], None]) -> None:
        """`answer(error)` once this engine can make no more images, from whichever thread finds
        out (the GPU worker's may be stuck). One process never is; a ranked engine is once one
        of its processes dies."""

    def _warm_up_images(self) -> None:
        self._calibrate_step_cache()  # first: a MagCache default needs its ratios for the warm-up
        for request in self.calls.warm_up_requests():
            self.generate(request)
        if self.previews is not None:  # the sketches' map fitted now, not inside a batch that asks for one
            self.previews.linear_map()

    def _calibrate_step_cache(self) -> None:
        """MagCache's ratios when the server may serve it (`StepCaching.calibrate`: the operator's
        file, or measured over the warm-up's image)."""
        self.step_cache.calibrate(self.generate, lambda: self.calls.warm_up_requests()[-1])

    def measure_magcache_ratios(self, request: GenerateRequest) -> list[float]:
        """MagCache's ratios over the image of `request` (its adapters applied), every step
        computed: at start-up over one image of the base model; a tool measures them with adapters."""
        return self.step_cache.measure_ratios(self.generate, request)

    def _make_store(self, layers: ModelLayers) -> AdapterStore:
        config = self.config
        unet = self.components.get("unet")
        target = TargetModel(self.model_name, type(self.pipeline), layers, self.dtype,
                             unet.config if unet is not None else None)
        limits = StoreLimits(config.sources.max_adapter_bytes, config.swap.max_rank, config.swap.max_blend,
                             config.swap.prefetch_threads)
        return AdapterStore(build_sources(config.sources.settings()), target, config.cache, self.device, limits)

    # ---------------------------------------------------------------- adapters
    @property
    def applied_ids(self) -> tuple[tuple[str, float], ...]:
        return tuple((held.adapter_id, weight) for held, weight in self._applied)

    @traced("swap", lambda engine, lease: adapter_attributes(lease.ids))
    @_on_its_device
    def apply(self, lease: Lease) -> float:
        """Put exactly the lease's adapters on the model; seconds spent swapping (0 if already
        so). The lease stays the caller's to give back."""
        held = lease.held
        self.swapper.check(held)  # a refusal changes nothing, the applied adapters included
        if len(held) == len(self._applied) and all(
                a is b and wa == wb for (a, wa), (b, wb) in zip(held, self._applied)):
            return 0.0  # the same held adapters: a file changed on disk is re-read into a new one
        try:
            seconds = self.swapper.apply(held)
        except BaseException:
            self._applied = []  # a swap that fails leaves the base model
            raise
        self._applied = list(held)
        logger.debug("swap to %s in %.1f ms", lease.ids or "base", seconds * 1e3)
        return seconds

    @_on_its_device
    def restore_base(self) -> None:
        """Back to the base model: no adapter applied."""
        self.swapper.restore_base()
        self._applied = []

    def keep_adapter(self, ref: AdapterRef, location: AdapterLocation | None = None) -> BoundAdapter:
        """Read the adapter now and keep it cached until evicted (`location`: its file, when
        routing found it, as `AdapterStore.keep` takes it)."""
        return self.adapters.keep(ref, location)

    def evict_adapter(self, ref: AdapterRef, download_too: bool = True,
                      location: AdapterLocation | None = None) -> None:
        """Stop keeping the adapter and drop it from the cache, and with `download_too` its
        downloaded file (read, or fetched, again when next used); `location` as `keep_adapter`'s."""
        if download_too:
            self.adapters.evict(ref, location)
        else:
            self.adapters.cache.evict(ref.adapter_id)

    def set_adapters(self, loras: list) -> float:
        """`apply` for a caller on one thread: the adapters leased for the call (refs, or
        `(id, weight)` pairs: `reference.as_refs`)."""
        with self.lender.lease_now(as_refs(loras)) as lease:
            return self.apply(lease)

    # ---------------------------------------------------------------- generation
    def generate(self, request: GenerateRequest,
                 on_step: Callable[[int, int], None] | None = None) -> GenerateResult:
        """One image (or video) for a caller on one thread: its adapters leased for the call (a
        copy with other adapters is `request.with_loras(...)`); `on_step(done, total)` after each
        denoising step (a progress bar)."""
        with self.lender.lease_now(request.loras) as lease:
            return self.generate_batch([request], lease, on_step=on_step)[0]

    @_on_its_device
    def generate_batch(self, requests: list[GenerateRequest], lease: Lease,
                       on_step: Callable[[int, int], None] | None = None,
                       on_latents: Callable | None = None) -> list[GenerateResult]:
        """Images for requests sharing adapters and parameters, in one pipeline call, with the
        adapters `lease` holds (the requests' own, from `lender`); `on_step(done, total)` after
        each denoising step, and `on_latents(done, total, previews.StepLatents)` for pictures of it.

        Each image has its own prompt and seed (a generator per image), so it is the image
        the request would get alone, up to the numerics of a larger batch.
        """
        # 1. the pipeline that takes these inputs and its call, refused before anything changes
        batch = self.prepare_batch(requests, on_step, on_latents)
        # 2. the requested adapters on the model (checked before anything changes)
        swap_seconds = self.apply(lease)
        # 3. generate
        return self.run_batch(batch, lease, swap_seconds)

    def prepare_batch(self, requests: list[GenerateRequest], on_step: Callable[[int, int], None] | None = None,
                      on_latents: Callable | None = None) -> Batch:
        """The pipeline call that makes `requests`, its seeds chosen (they drive CPU generators, as
        the HF image does); a request the model cannot take is refused here, before anything changes."""
        task = self.calls.task(requests[0])
        skips = self.step_cache.skips_for(requests[0])
        kwargs = self.calls.arguments(task, requests)
        latents_hook = self.previews.hook(on_latents, kwargs, requests[0].image) \
            if on_latents and self.previews else None
        kwargs |= self.calls.progress(task, self.step_cache.counting(skips, on_step), latents_hook)
        pipeline = self.pipeline if task == TEXT else self.calls.pipeline(task)  # the loaded one, for text
        seeds = [r.seed if r.seed is not None else random.randrange(2**31) for r in requests]
        return Batch(requests, seeds, task, pipeline, kwargs, skips)

    @_on_its_device
    def run_batch(self, batch: Batch, lease: Lease, swap_seconds: float) -> list[GenerateResult]:
        """The batch's images, made with the adapters `lease` holds already applied."""
        task, kwargs, skips = batch.task, batch.kwargs, batch.skips

        # generators made per attempt: a call retried cold starts from the seeds again
        @traced("generate", lambda: generation_attributes(self.model_name, batch.requests, kwargs))
        def run() -> list[list[Image.Image]]:
            generators = [torch.Generator("cpu").manual_seed(seed) for seed in batch.seeds]
            with (torch.inference_mode(), self.attention.context() if self.attention else contextlib.nullcontext(),
                  self.step_cache.for_attempt(skips, kwargs, self.calls.parameters(task))):
                output = batch.pipeline(**self.pipeline_arguments(kwargs), generator=generators)
            return self.calls.outputs(task, output)

        started = time.perf_counter()
        # the model's first image goes through the start-up (a cold retry, its figures); the rest straight
        videos = run() if self._startup.first_image_done else self._startup.first_image(
            run, self.model_name, retry=self.retries_first_image)
        seconds = time.perf_counter() - started
        fps = self.calls.family.fps if self.calls.is_video else None
        cached = self.step_cache.result_fields(skips)
        ran = self.calls.ran(task, kwargs, self.model_name, lease.held)
        return [GenerateResult(frames[0], seed, swap_seconds, seconds, frames if fps else None, fps, **cached, ran=ran)
                for frames, seed in zip(videos, batch.seeds)]

    # ---------------------------------------------------------------- state
    def capabilities(self) -> dict:
        """What the model takes and makes (`PipelineCalls.capabilities`) and the step caches it serves
        (`StepCaching.capabilities`)."""
        return self.calls.capabilities() | self.step_cache.capabilities()

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, denoiser_name(self.pipeline))

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Start-up seconds by phase: load_s, warmup_s, first_image_s (and prewarm_s)."""
        return self._startup.figures

    @property
    def compile_cache(self):
        """torch.compile's cache folder in use (a fresh one after a cold retry), or None."""
        return self._startup.compile_cache

    @property
    def compile_cache_lookups(self) -> dict[str, dict[str, int]] | None:
        """torch's compile cache hits and misses until the first image."""
        return self._startup.compile_cache_lookups

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up: a swap must never add one."""
        return graph_count() - self._graphs_after_warmup
