"""What the HTTP handlers run over: the models of this process, or a Ray Serve deployment.

The handlers (`routes/`) parse and answer; a backend routes a request to the engine
hosting its base model and generates. `LocalBackend` drives engines and GPU workers in
this process (`loraswap serve`); `cluster.ingress.RayBackend` calls model replicas
through Ray Serve handles (`loraswap serve --ray`, `loraswap deploy`). Both raise the
same `LoraswapError`s, so the HTTP contract is one, and share the rule that picks a
request's model (`routing.route_by_base_model`), the wait on a result that watches for
the client leaving (`wait_for_result`) and the merged adapter table (`merge_adapter_rows`).
"""

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from fastapi.concurrency import run_in_threadpool

from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.download_locks import holding_downloads_in_coroutine
from loraswap.engine.engine import Engine, GenerateResult
from loraswap.engine.parallel.loss import RanksLost
from loraswap.engine.process import freeze_loaded_objects, unfreeze_objects
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker, ShuttingDown
from loraswap.errors import AdapterIncompatible, AdapterInvalid, Overloaded
from loraswap.server.config import ServerConfig
from loraswap.server.fetch_pool import FetchPool
from loraswap.server.metrics import EngineFigures
from loraswap.server.routing import Deployment, Hosted, Route, merge_adapter_rows

logger = logging.getLogger("loraswap.server")

T = TypeVar("T")


StepCallback = Callable[[int, int], None]
"""A request's progress hook: (steps done, steps in all), called once per denoising step from the
engine's thread (a video job's `videos.VideoJob.report_step`; the progress board's `Tracked`). An
`engine.step_listener.StepListener` also hears its place in the queue and pictures of its steps."""


class ClientGone(Exception):
    """The client disconnected while its request waited; the request was cancelled."""


POLL_S = 0.1  # how often a waiting request asks whether its client is still there
STOP_WAIT_S = 600.0  # how long a cancelled request waits for its generation to stop (a step of a long video)


async def wait_for_result(task: "asyncio.Future[T]", cancel: Callable[[], object],
                          is_disconnected: Callable[[], Awaitable[bool]] | None) -> T:
    """The task's result; `cancel()` and `ClientGone` if the client leaves first. Cancelled
    itself (the proxy gives up on a request whose client left, a video job is deleted), it
    cancels too. Either way it returns once the work has stopped (a running generation stops
    at its next step), so that what counts work in flight counts it until then."""
    try:
        while not task.done():
            await asyncio.wait([task], timeout=POLL_S)
            if not task.done() and is_disconnected is not None and await is_disconnected():
                await _cancel_and_wait(task, cancel)
                raise ClientGone()
    except asyncio.CancelledError:
        await _cancel_and_wait(task, cancel)
        raise
    return task.result()


async def _cancel_and_wait(task: "asyncio.Future", cancel: Callable[[], object]) -> None:
    cancel()
    if not (await asyncio.wait([task], timeout=STOP_WAIT_S))[0]:
        logger.warning("a cancelled request is still running after %g s", STOP_WAIT_S)
    elif not task.cancelled():
        task.exception()  # how it stopped is nobody's news: taken, so that asyncio logs nothing


class Backend(Protocol):
    load_error: str | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready_info(self) -> dict | None:
        """/ready's answer once serving ({"model", "models", "compiled", "capabilities": model ->
        what it takes and makes}); None while loading."""

    def is_model(self, name: str) -> bool:
        """Whether `name` is a hosted base model (else it names an adapter); 503 while loading."""

    async def generate(self, request: GenerateRequest, model: str | None,
                       is_disconnected: Callable[[], Awaitable[bool]] | None,
                       on_step: StepCallback | None = None) -> GenerateResult:
        """Route by base model (or `model`), generate; `ClientGone` if the client left first
        (`is_disconnected` None: nobody waits, nothing cancels). `on_step`: the request's
        progress hook (`StepCallback`), for the engine to call per denoising step."""

    async def list_adapters(self) -> dict:
        """{"model", "models", "adapters"}: one row per adapter over every model (`merge_adapter_rows`)."""

    async def keep_adapter(self, ref: AdapterRef) -> dict:
        """Read the adapter now on the model it routes to and keep it; {"bytes", "layers", "model"}."""

    async def evict_adapter(self, ref: AdapterRef) -> None:
        """Stop keeping the adapter and drop it from every tier of the model it routes to."""

    async def figures(self) -> EngineFigures: ...


SERVED_POLL_S = 0.2  # how often work waiting for the model asks whether it serves


async def until_served(backend: Backend) -> bool:
    """Wait until `backend` serves (True) or its model failed to load (False): for work a
    restart left (video jobs, kept adapters) that would only fail before, and must not
    hold up /ready."""
    while backend.ready_info() is None and backend.load_error is None:
        await asyncio.sleep(SERVED_POLL_S)
    return backend.load_error is None


def not_ready(load_error: str | None) -> Overloaded:
    """The 503 of a backend whose model is not serving yet: still loading, or failed to load."""
    return Overloaded(f"loading failed: {load_error}" if load_error else "the model is still loading")


class LocalBackend:
    """Engines and their GPU workers in this process, built by a loader thread at start-up.

    The loaded models are the app's `state.deployment` (`routing.Deployment`: each hosted
    model's engine and GPU worker, the default model first), empty while loading.
    """

    def __init__(self, state, config: ServerConfig, engine_factory=Engine):
        self.state = state
        self.config = config
        self.engine_factory = engine_factory
        state.deployment = Deployment()  # empty until every model is loaded
        state.load_error = None
        self.fetch_pool = FetchPool()  # for finding adapters that may wait on the network (`_find`)

    @property
    def load_error(self) -> str | None:
        return self.state.load_error

    async def start(self) -> None:
        threading.Thread(target=self._load, name="loraswap-loader", daemon=True).start()

    def drain(self) -> None:
        """The start of a shutdown: new requests refused and queued ones answered now (503); those
        running go on until `halt`."""
        for hosted in self.state.deployment.hosted:
            if queued := hosted.worker.drain():
                logger.info("shutting down %s: %d queued requests answered 503", hosted.engine.model_name, queued)

    def halt(self) -> None:
        """The drain time is up: the running images stop at their next step (answered 503)."""
        for hosted in self.state.deployment.hosted:
            if running := hosted.worker.halt():
                logger.info("shutting down %s: stopping %d running requests at their next step",
                            hosted.engine.model_name, running)

    async def stop(self) -> None:
        self.drain()  # what is left once the connections have closed (a video stopping), or a test's app
        self.halt()
        for hosted in self.state.deployment.hosted:
            await run_in_threadpool(hosted.worker.stop)
            hosted.engine.adapters.close()
        self.fetch_pool.close()
        unfreeze_objects()

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
            freeze_loaded_objects()  # before ready: its one full collection is no request's wait
            state.deployment = Deployment(hosted)
            logger.info("ready: %s in %.1f s", ", ".join(h.engine.model_name for h in hosted),
                        time.perf_counter() - started)
        except Exception as e:
            state.load_error = str(e) or type(e).__name__  # never empty: empty reads as still loading
            logger.exception("loading %s failed", loading["model"])
        finally:
            done.set()

    def _deployment(self) -> Deployment:
        if not self.state.deployment.hosted:
            raise not_ready(self.load_error)
        return self.state.deployment

    def ready_info(self) -> dict | None:
        deployment = self.state.deployment
        if not deployment.hosted:
            return None
        default = deployment.hosted[0].engine
        return {"model": default.model_name, "models": deployment.names, "compiled": default.compiled,
                "capabilities": {h.engine.model_name: h.engine.capabilities() for h in deployment.hosted}}

    def is_model(self, name: str) -> bool:
        return self._deployment().by_name(name) is not None

    async def generate(self, request: GenerateRequest, model: str | None,
                       is_disconnected: Callable[[], Awaitable[bool]] | None,
                       on_step: StepCallback | None = None) -> GenerateResult:
        # the engine hosting the adapters' base model (unknown ids: 404 at once); its worker
        # leases the adapters, read on the store's pool while earlier requests generate
        # (downloads on their own pool; the files found are in use, never evicted, until answered)
        async with holding_downloads_in_coroutine():
            route = await self._find(request.loras, self._route, request.loras, model)
            hosted = route.hosted
            request = hosted.engine.calls.sized(request)  # beyond the model's largest size: 400 before queueing
            request = hosted.engine.step_cache.resolved(request)  # a step cache it cannot take: refused now too
            try:
                future = hosted.worker.submit(request, on_step, route.located)  # (the files its store found)
                return await wait_for_result(asyncio.wrap_future(future), future.cancel, is_disconnected)
            except (RanksLost, ShuttingDown):  # the process exits (for a restart) in a moment
                if is_disconnected is None:  # a video job: left unfinished in its state, for the restart to make
                    await asyncio.Event().wait()
                raise

    async def _find(self, refs: list[AdapterRef], call: Callable[..., T], *args) -> T:
        """`call(*args)` off the event loop: on the fetch pool when finding these adapters may
        wait on the network (a download, the Hub), else on AnyIO's pool (`fetch_pool.py`)."""
        sources = self._deployment().hosted[0].engine.adapters.source
        return await self.fetch_pool.run(sources, refs, call, *args)

    def _route(self, refs: list[AdapterRef], model: str | None = None) -> Route:
        deployment = self._deployment()
        try:
            return deployment.route(refs, model)
        except (AdapterInvalid, AdapterIncompatible) as e:
            refused = next((ref for ref in refs if ref.adapter_id == e.adapter_id), None)
            if refused is not None:
                self._maybe_evict_download(deployment, refused)
            raise

    @staticmethod
    def _maybe_evict_download(deployment: Deployment, ref: AdapterRef) -> None:
        """Drop a download that routing refused when no hosted model can take it (a defect of the
        file, a base model not hosted, layers that fit none): neither listed nor kept. One that
        another hosted model takes (refused for the model named, or for its blend) stays."""
        adapter_id = ref.adapter_id
        sources = deployment.hosted[0].engine.adapters.source
        remote = getattr(sources, "remote", None)
        if remote is None or ref.source == "name" or not remote.has(adapter_id):
            return  # not a download, or gone: routing it alone would fetch it again
        try:
            deployment.route([ref])  # alone, to whichever hosted model takes it
        except (AdapterInvalid, AdapterIncompatible) as alone:
            if alone.adapter_id == adapter_id:
                sources.evict(adapter_id)
        except Exception:  # any other failure says nothing about the file: it stays
            logger.debug("routing %s alone failed; its download stays", adapter_id, exc_info=True)

    async def list_adapters(self) -> dict:
        deployment = self._deployment()

        def rows():
            return merge_adapter_rows((h.engine.model_name, row) for h in deployment.hosted
                                      for row in h.engine.adapters.rows(h.engine.applied_ids))

        return {"model": deployment.names[0], "models": deployment.names, "adapters": await run_in_threadpool(rows)}

    async def keep_adapter(self, ref: AdapterRef) -> dict:
        def keep():
            route = self._route([ref])  # the file found once, here, and kept as found (`Route.located`)
            engine = route.hosted.engine
            bound = engine.keep_adapter(ref, route.located.get(ref.adapter_id))
            return {"bytes": bound.nbytes, "layers": len(bound.layers), "model": engine.model_name}

        return await self._find([ref], keep)

    async def evict_adapter(self, ref: AdapterRef) -> None:
        def evict():
            # every engine caching it (a request naming a model may have put it on another
            # than its own), else the one it routes to: routing finds its file (404 for an
            # unknown id) and the store evicts it without looking again
            deployment = self._deployment()
            holding = [h for h in deployment.hosted if h.engine.adapters.cache.get(ref.adapter_id) is not None]
            for hosted in holding:
                hosted.engine.evict_adapter(ref)
            if not holding:
                route = deployment.route([ref])
                route.hosted.engine.evict_adapter(ref, location=route.located.get(ref.adapter_id))

        await self._find([ref], evict)

    async def figures(self) -> EngineFigures:
        total = EngineFigures()
        hosted = self.state.deployment.hosted
        for h in hosted:
            total.add(EngineFigures.of(h.engine, h.worker))
        total.ready = bool(hosted)
        return total
