"""What the HTTP handlers run over: the models of this process, or a Ray Serve deployment.

The handlers in `app.py` validate and answer; a backend routes a request to the engine
hosting its base model and generates. `LocalBackend` drives engines and GPU workers in
this process (`loraswap serve`); `cluster.ingress.RayBackend` calls model replicas
through Ray Serve handles (`loraswap serve --ray`, `loraswap deploy`). Both raise the
same `LoraswapError`s, so the HTTP contract is one.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi.concurrency import run_in_threadpool

from ..adapters.cache import Tier
from ..engine.config import GenerateRequest
from ..engine.engine import Engine, GenerateResult
from ..engine.worker import GpuWorker
from ..errors import Overloaded
from .config import ServerConfig
from .routing import Deployment, Hosted

logger = logging.getLogger("loraswap.server")


class ClientGone(Exception):
    """The client disconnected while its request waited; the request was cancelled."""


@dataclass
class EngineFigures:
    """Engine and worker figures for /metrics, summed over the engines serving."""

    recompiles: int = 0
    cache_hits: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in (Tier.HOST, Tier.GPU)})
    cache_misses: int = 0
    cache_bytes: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in (Tier.HOST, Tier.GPU)})
    queue_depth: int = 0
    cancelled: int = 0
    ready: bool = False
    replicas: list[dict] = field(default_factory=list)  # Ray: one row per model replica
    # per model: start-up seconds by phase (`Engine.startup`) and torch's compile cache lookups
    # until its first image (`Engine.compile_cache_lookups`); the slowest replica's, the lookups summed
    startup: dict[str, dict[str, float]] = field(default_factory=dict)
    compile_cache: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def add(self, other: "EngineFigures", gauges: bool = True) -> None:
        """Add another engine's counters (and its gauges unless it is gone)."""
        self.recompiles += other.recompiles
        self.cache_misses += other.cache_misses
        self.cancelled += other.cancelled
        for tier, hits in other.cache_hits.items():
            self.cache_hits[tier] = self.cache_hits.get(tier, 0) + hits
        if gauges:
            self.queue_depth += other.queue_depth
            for tier, nbytes in other.cache_bytes.items():
                self.cache_bytes[tier] = self.cache_bytes.get(tier, 0) + nbytes
            for model, phases in other.startup.items():
                mine = self.startup.setdefault(model, {})
                for phase, seconds in phases.items():
                    mine[phase] = max(mine.get(phase, 0.0), seconds)
            for model, caches in other.compile_cache.items():
                mine = self.compile_cache.setdefault(model, {})
                for cache, results in caches.items():
                    into = mine.setdefault(cache, {})
                    for result, n in results.items():
                        into[result] = into.get(result, 0) + n


def engine_figures(engine: Engine, worker: GpuWorker) -> EngineFigures:
    return EngineFigures(
        recompiles=engine.recompiles, cache_misses=engine.cache.misses, cancelled=worker.skipped_cancelled,
        cache_hits={t.value: engine.cache.hits[t.value] for t in (Tier.HOST, Tier.GPU)},
        cache_bytes={t.value: engine.cache.used(t) for t in (Tier.HOST, Tier.GPU)},
        queue_depth=worker.queue_depth, ready=True, startup={engine.model_name: dict(engine.startup)},
        compile_cache={engine.model_name: engine.compile_cache_lookups} if engine.compile_cache_lookups else {})


class Backend(Protocol):
    load_error: str | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready_info(self) -> dict | None:
        """/ready's answer once serving ({"model", "models", "compiled"}); None while loading."""

    def is_model(self, name: str) -> bool:
        """Whether `name` is a hosted base model (else it names an adapter); 503 while loading."""

    async def generate(self, request: GenerateRequest, model: str | None,
                       is_disconnected: Callable[[], Awaitable[bool]]) -> GenerateResult:
        """Route by base model (or `model`), generate; `ClientGone` if the client left first."""

    async def list_adapters(self) -> dict: ...

    async def pin_adapter(self, adapter_id: str) -> dict:
        """Read the adapter now and pin it; {"bytes", "layers"}."""

    async def unpin_adapter(self, adapter_id: str) -> None: ...

    async def figures(self) -> EngineFigures: ...


class LocalBackend:
    """Engines and their GPU workers in this process, built by a loader thread at start-up.

    The loaded models are also set on the app's `state` (`deployment`, and `engine` /
    `worker` of the default model) for tests and tools that reach into the server.
    """

    def __init__(self, state, config: ServerConfig, engine_factory=Engine):
        self.state = state
        self.config = config
        self.engine_factory = engine_factory
        state.engine = None  # the default model's engine and worker, once loaded
        state.worker = None
        state.deployment = Deployment()
        state.load_error = None

    @property
    def load_error(self) -> str | None:
        return self.state.load_error

    async def start(self) -> None:
        threading.Thread(target=self._load, name="loraswap-loader", daemon=True).start()

    async def stop(self) -> None:
        for hosted in self.state.deployment.hosted:
            logger.info("shutting down %s: finishing %d queued requests", hosted.engine.model_name,
                        hosted.worker.queue_depth)
            await run_in_threadpool(hosted.worker.stop)

    def _load(self) -> None:
        """Build and warm every engine, logging progress until all are ready."""
        config, state = self.config, self.state
        started = time.perf_counter()
        done = threading.Event()
        loading = {"model": config.engines[0].model}

        def heartbeat():
            while not done.wait(10.0):
                logger.info("still loading %s (%.0f s)", loading["model"], time.perf_counter() - started)

        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            hosted = []
            for engine_config in config.engines:
                loading["model"] = engine_config.model
                engine = self.engine_factory(engine_config)
                worker = GpuWorker(engine, config.scheduler)
                worker.start()
                hosted.append(Hosted(engine, worker))
            state.deployment = Deployment(hosted)
            state.engine, state.worker = hosted[0].engine, hosted[0].worker
            logger.info("ready: %s in %.1f s", ", ".join(h.engine.model_name for h in hosted),
                        time.perf_counter() - started)
        except Exception as e:
            state.load_error = str(e)
            logger.exception("loading %s failed", loading["model"])
        finally:
            done.set()

    def _deployment(self) -> Deployment:
        if self.state.worker is None:
            reason = f"loading failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise Overloaded(reason)
        return self.state.deployment

    def ready_info(self) -> dict | None:
        if self.state.worker is None:
            return None
        return {"model": self.state.engine.model_name, "models": self.state.deployment.names,
                "compiled": self.state.engine.compiled}

    def is_model(self, name: str) -> bool:
        return self._deployment().by_name(name) is not None

    async def generate(self, request: GenerateRequest, model: str | None,
                       is_disconnected: Callable[[], Awaitable[bool]]) -> GenerateResult:
        # the engine hosting the adapters' base model (unknown ids: 404 at once); the adapters
        # are read on its prefetch pool while earlier requests generate, so its worker only
        # restores and fuses
        hosted = await run_in_threadpool(self._deployment().route, request.loras, model)
        future = hosted.worker.submit(request, hosted.engine.prefetch(request.loras))
        wrapped = asyncio.wrap_future(future)
        while not wrapped.done():
            await asyncio.wait([wrapped], timeout=0.1)
            if not wrapped.done() and await is_disconnected():
                future.cancel()
                raise ClientGone()
        return wrapped.result()

    async def list_adapters(self) -> dict:
        deployment = self._deployment()
        engine = deployment.hosted[0].engine
        return {"model": engine.model_name, "models": deployment.names,
                "adapters": await run_in_threadpool(engine.list_adapters)}

    async def pin_adapter(self, adapter_id: str) -> dict:
        bound = await run_in_threadpool(self._deployment().hosted[0].engine.pin_adapter, adapter_id)
        return {"bytes": bound.nbytes, "layers": len(bound.layers)}

    async def unpin_adapter(self, adapter_id: str) -> None:
        await run_in_threadpool(self._deployment().hosted[0].engine.unpin_adapter, adapter_id)

    async def figures(self) -> EngineFigures:
        total = EngineFigures()
        hosted = self.state.deployment.hosted
        for h in hosted:
            total.add(engine_figures(h.engine, h.worker))
        total.ready = bool(hosted)
        return total
