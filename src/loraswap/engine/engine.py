"""The engine: one warm base model, its fused swapper and its adapters.

Public surface: `Engine(config)`, `generate(request)`, `resolve_adapter(id)`,
`set_adapters(loras)`, `recompiles`. Not thread-safe: exactly one worker thread
drives an engine (the server's GPU worker, or the CLI).
"""

import inspect
import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from PIL import Image
from torch._dynamo.utils import counters

from ..adapters.formats import ParsedAdapter, load_adapter
from ..adapters.metadata import same_model
from ..adapters.source import LocalAdapterSource, check_adapter_id
from ..errors import AdapterIncompatible, AdapterNotFound, BadRequest
from ..models import generation_defaults, load_pipeline, model_name, resolve_device
from .baseline import DiffusersLoadFuse
from .config import EngineConfig, GenerateRequest
from .swap import BoundAdapter, FusedSwapper

logger = logging.getLogger(__name__)


@dataclass
class GenerateResult:
    image: Image.Image
    seed: int
    swap_seconds: float  # 0 when the wanted adapters were already applied
    generate_seconds: float


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = config.torch_dtype(self.device)
        started = time.perf_counter()
        logger.info("loading %s on %s (%s)", config.model, self.device, self.dtype)
        self.pipeline = load_pipeline(config.model, device=self.device, dtype=self.dtype)
        self.model_name = model_name(self.pipeline, config.model)
        self.components = {name: getattr(self.pipeline, name) for name in self.pipeline._lora_loadable_modules
                           if getattr(self.pipeline, name, None) is not None}
        self.unet_config = self.components["unet"].config if "unet" in self.components else None
        self.swapper = FusedSwapper(self.components, pristine=config.pristine, max_rank=config.max_rank)
        self.source = LocalAdapterSource(config.adapters) if config.adapters else None
        self._adapters: OrderedDict[str, tuple[BoundAdapter, tuple[int, int]]] = OrderedDict()
        self._adapters_lock = threading.Lock()
        self._pinned: set[str] = set()
        self.cache_hits = 0
        self.cache_misses = 0
        self._call_parameters = set(inspect.signature(self.pipeline.__call__).parameters)
        self.defaults = generation_defaults(config.model)
        self.baseline = DiffusersLoadFuse(self.pipeline) if config.swap_mode == "diffusers" else None
        self.compiled = config.compile if config.compile is not None else self.device.type == "cuda"
        if self.baseline is not None and self.compiled:
            logger.info("--swap-mode diffusers runs eager, as seed 1 did: not compiling")
            self.compiled = False
        if self.compiled:
            self._compile()
        if config.warmup:
            logger.info("warming up%s", " (compiling)" if self.compiled else "")
            self.generate(GenerateRequest(prompt="warm-up", seed=0, steps=2))
        self._graphs_after_warmup = self._graph_count()
        logger.info("%s ready in %.1f s", self.model_name, time.perf_counter() - started)

    # ---------------------------------------------------------------- adapters
    def resolve_adapter(self, adapter_id: str) -> BoundAdapter:
        """The adapter, read, converted and checked against this model (cached by id).

        A cached entry is dropped when its file's size or mtime changes on disk.
        """
        location = self._locate(adapter_id)
        if self.baseline is not None:
            return location  # seed 1 validates nothing and reads the file on every swap
        stat = location.weights.stat()
        stamp = (stat.st_size, stat.st_mtime_ns)
        with self._adapters_lock:
            cached = self._adapters.get(adapter_id)
            if cached and cached[1] == stamp:
                self._adapters.move_to_end(adapter_id)
                self.cache_hits += 1
                return cached[0]
            self.cache_misses += 1
        parsed = load_adapter(location, type(self.pipeline), self.swapper.component_modules,
                              int(self.config.max_adapter_mb * 2**20), self.unet_config)
        self._check_base_model(parsed)
        # host tier: one flat buffer in the model's dtype (pinned on CUDA: one fast copy per swap)
        bound = self.swapper.bind(parsed, base_models=parsed.base_models, dtype=self.dtype,
                                  pin_memory=self.device.type == "cuda")
        with self._adapters_lock:
            self._adapters[adapter_id] = (bound, stamp)
            self._adapters.move_to_end(adapter_id)
            unpinned = [aid for aid in self._adapters if aid not in self._pinned]
            for aid in unpinned[: max(0, len(self._adapters) - self.config.adapter_cache_size)]:
                del self._adapters[aid]
        return bound

    def _locate(self, adapter_id: str):
        check_adapter_id(adapter_id)
        if self.source is None:
            raise AdapterNotFound(adapter_id, "this server was started without an adapter folder",
                                  "Start it with --adapters DIR")
        return self.source.locate(adapter_id)

    def pin_adapter(self, adapter_id: str) -> BoundAdapter:
        """Load the adapter into host RAM and keep it there until `unpin_adapter`."""
        bound = self.resolve_adapter(adapter_id)
        with self._adapters_lock:
            self._pinned.add(adapter_id)
        return bound

    def unpin_adapter(self, adapter_id: str) -> None:
        """Unpin and drop the adapter from host RAM (it is read from disk when next used)."""
        self._locate(adapter_id)
        with self._adapters_lock:
            self._pinned.discard(adapter_id)
            self._adapters.pop(adapter_id, None)

    def list_adapters(self) -> list[dict]:
        """Every adapter in the folder: id, where it is cached, and what is known of it."""
        if self.source is None:
            return []
        with self._adapters_lock:
            cached = {aid: bound for aid, (bound, _) in self._adapters.items()}
            pinned = set(self._pinned)
        applied = {aid for aid, _ in self.swapper.applied_ids}
        rows = []
        for adapter_id in self.source.list_ids():
            bound = cached.get(adapter_id)
            row = {"id": adapter_id, "cached": "host" if bound else "disk", "pinned": adapter_id in pinned,
                   "applied": adapter_id in applied}
            if bound is not None:
                row.update(base_model=bound.base_models[0] if bound.base_models else self.model_name,
                           rank=max(layer.rank for layer in bound.layers.values()), bytes=bound.nbytes,
                           layers=len(bound.layers))
            rows.append(row)
        return rows

    def _check_base_model(self, parsed: ParsedAdapter) -> None:
        if parsed.base_models and not any(same_model(name, self.model_name) for name in parsed.base_models):
            raise AdapterIncompatible(
                parsed.adapter_id, f"it was made for {', '.join(parsed.base_models)}, and this server hosts "
                f"{self.model_name}", f"Send it to a server hosting {parsed.base_models[0]}")

    def set_adapters(self, loras: list[tuple[str, float]]) -> float:
        """Apply exactly these adapters (id, weight); seconds spent swapping (0 if already so)."""
        if len(loras) > self.config.max_blend:
            raise BadRequest(f"{len(loras)} adapters requested; at most {self.config.max_blend} can be blended")
        if len({aid for aid, _ in loras}) != len(loras):
            raise BadRequest("the same adapter is named twice; give it one weight")
        if self.baseline is not None:
            if self.baseline.applied_ids == tuple(loras):
                return 0.0
            return self.baseline.apply([(self._locate(aid), float(weight)) for aid, weight in loras])
        bound = [(self.resolve_adapter(aid), float(weight)) for aid, weight in loras]
        applied = self.swapper.applied
        if len(applied) == len(bound) and all(a is b and wa == wb for (a, wa), (b, wb) in zip(applied, bound)):
            return 0.0  # same adapter objects: a file changed on disk is re-read, so it is a new object
        seconds = self.swapper.apply(bound)
        logger.debug("swap to %s in %.1f ms", loras or "base", seconds * 1e3)
        return seconds

    # ---------------------------------------------------------------- generation
    def generate(self, request: GenerateRequest) -> GenerateResult:
        # 1. put the requested adapters on the model (validated before anything changes)
        swap_seconds = self.set_adapters(request.loras)
        # 2. build the pipeline call; the seed drives a CPU generator, as the HF image does
        seed = request.seed if request.seed is not None else random.randrange(2**31)
        kwargs = dict(prompt=request.prompt, generator=torch.Generator("cpu").manual_seed(seed))
        defaults = self.defaults
        optional = dict(negative_prompt=request.negative_prompt, guidance_scale=request.guidance,
                        num_inference_steps=request.steps or defaults.get("steps"),
                        width=request.width or defaults.get("width"), height=request.height or defaults.get("height"))
        kwargs.update({k: v for k, v in optional.items() if v is not None and k in self._call_parameters})
        # 3. generate
        started = time.perf_counter()
        with torch.inference_mode():
            image = self.pipeline(**kwargs).images[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return GenerateResult(image, seed, swap_seconds, time.perf_counter() - started)

    # ---------------------------------------------------------------- compilation
    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipeline, "transformer", None) or self.pipeline.unet

    def _compile(self) -> None:
        denoiser = self.denoiser
        if getattr(denoiser, "_repeated_blocks", None):
            denoiser.compile_repeated_blocks(fullgraph=True)
        else:
            denoiser.compile(fullgraph=False)

    @staticmethod
    def _graph_count() -> int:
        return counters["stats"]["unique_graphs"]

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warm-up: a swap must never add one."""
        return self._graph_count() - self._graphs_after_warmup
