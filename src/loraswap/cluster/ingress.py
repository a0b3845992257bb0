"""The HTTP ingress of a Ray Serve deployment: the server's own FastAPI app over Ray handles.

`Ingress` serves `server.app.create_app` (same handlers, schemas, errors and metrics)
with a `RayBackend`: routing by base model happens here, with the same rule and the
same adapter sources as the single-process server; generation goes to the model's
deployment through its handle, with the request's adapter set as the multiplexed model
id, so Serve picks a replica that holds it. No GPU and no multiplexing here.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from fastapi import Depends
from fastapi.concurrency import run_in_threadpool
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from loraswap.adapters.files.metadata import same_model
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.choose import build_sources
from loraswap.cluster.config import ClusterConfig
from loraswap.cluster.replica import adapter_key, log_to_stderr
from loraswap.engine.engine import GenerateResult
from loraswap.engine.parallel.loss import RanksLost
from loraswap.engine.request import GenerateRequest
from loraswap.errors import LoraswapError, Overloaded
from loraswap.server.app import create_app
from loraswap.server.auth import Access, require_admin_key
from loraswap.server.backend import StepCallback, wait_for_result
from loraswap.server.metrics import EngineFigures
from loraswap.server.routing import HostedModel, merge_adapter_rows, route_by_base_model

logger = logging.getLogger("loraswap.cluster")

# a replica that died, or one whose context-parallel ranks were lost (it answers 503, then exits)
REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError, RanksLost)
ATTEMPTS = 3  # a request whose replica died under it is sent again (generation has no side effects)


class RayBackend:
    """The models are Ray Serve deployments (handles in `config.engines` order)."""

    def __init__(self, config: ClusterConfig, models: list, reports):
        self.config = config
        self.handles = models
        self.reports = reports
        self.deployments = [engine.deployment_name for engine in config.engines]
        self.source = build_sources(config.engines[0].sources.settings())  # the default engine's sources
        self.names: list[str] | None = None  # the models' names, once their replicas answered
        self.families: list[str | None] = []  # their families (routing an adapter that names no base model)
        self.compiled = False
        self.capabilities: dict[str, dict] = {}
        self.load_error: str | None = None
        self._connecting: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        while True:
            try:
                infos = await asyncio.gather(*(handle.info.remote() for handle in self.handles))
                break
            except Exception as e:  # replicas still starting, or one died: ask again
                logger.warning("waiting for model replicas: %s", e)
                await asyncio.sleep(1.0)
        self.names, self.compiled = [info["model"] for info in infos], infos[0]["compiled"]
        self.capabilities = {info["model"]: info.get("capabilities", {}) for info in infos}
        self.families = [info.get("family") for info in infos]
        logger.info("ingress ready: %s", ", ".join(f"{n} ({d})" for n, d in zip(self.names, self.deployments)))

    async def stop(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()

    def _names(self) -> list[str]:
        if self.names is None:
            raise Overloaded("the model replicas are still starting")
        return self.names

    def ready_info(self) -> dict | None:
        if self.names is None:
            return None
        return {"model": self.names[0], "models": self.names, "compiled": self.compiled,
                "capabilities": self.capabilities, "deployments": dict(zip(self.names, self.deployments))}

    def is_model(self, name: str) -> bool:
        return any(same_model(hosted, name) for hosted in self._names())

    # ---------------------------------------------------------------- routing
    def _route(self, refs: list[AdapterRef], model: str | None) -> int:
        names = self._names()
        # the ingress holds no model: an adapter naming no base model goes by its family, else to the default
        families = dict(zip(names, self.families))  # (empty until the replicas answered)
        hosted = [HostedModel(name, families.get(name)) for name in names]
        max_bytes = self.config.engines[0].sources.max_adapter_bytes
        return names.index(route_by_base_model(hosted, self.source.locate, refs, model, max_adapter_bytes=max_bytes))

    # ---------------------------------------------------------------- requests
    async def generate(self, request: GenerateRequest, model: str | None,
                       is_disconnected: Callable[[], Awaitable[bool]] | None,
                       on_step: StepCallback | None = None) -> GenerateResult:
        # `on_step` (a video job's progress) does not cross to the replica: a callable would
        # not pickle; reporting steps back needs a channel from replica to ingress
        index = await run_in_threadpool(self._route, request.loras, model)
        handle = self.handles[index].options(multiplexed_model_id=adapter_key(request.loras))
        sent = time.perf_counter()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                # (its adapter refs go with it, URLs and all: a replica on another node fetches them too)
                result = await self._call(lambda: handle.generate.remote(request), is_disconnected)
                # Serve's share: routing (waiting at the router), the hops both ways, and any
                # attempt a dying replica cost
                result.timings["ray"] = time.perf_counter() - sent - result.timings.pop("replica", 0.0)
                return result
            except REPLICA_GONE as e:
                if attempt == ATTEMPTS:
                    raise Overloaded("the replica serving this request went away; retry") from e
                logger.warning("replica of %s went away (%s); sending the request again",
                               self.deployments[index], type(e).__name__)
                await asyncio.sleep(0.2 * attempt)

    async def _call(self, send: Callable, is_disconnected: Callable[[], Awaitable[bool]] | None = None):
        """Await a handle call, as our own errors; cancel it if the client leaves."""
        try:
            response = send()
            task = asyncio.ensure_future(_result(response))

            def cancel():
                response.cancel()
                task.cancel()

            return await wait_for_result(task, cancel, is_disconnected)
        except RayTaskError as e:
            if isinstance(e.cause, (LoraswapError, torch.OutOfMemoryError)):
                raise e.cause from None
            raise
        except BackPressureError:
            raise Overloaded(f"the queue is full ({self.config.scheduler.max_queue} requests waiting); "
                             "retry shortly") from None

    # ---------------------------------------------------------------- adapters
    async def list_adapters(self) -> dict:
        """Every adapter in the folder or cached by a live replica (hub ones too), as the local
        server lists them, with the replicas holding each."""
        names = self._names()
        reports = [r for r in await self._call(lambda: self.reports.collect.remote()) if r["alive"]]
        ids = await run_in_threadpool(self.source.list_ids)
        on_disk = {"cached": "disk", "kept": False, "applied": False}
        rows = [(None, {"id": adapter_id, **on_disk}) for adapter_id in ids]
        rows += [(report["model"], row) for report in reports for row in report["cache"]]
        holders: dict[str, set[str]] = {}
        for report in reports:
            for row in report["cache"]:
                holders.setdefault(row["id"], set()).add(report["replica"])
        adapters = [{**row, "replicas": sorted(holders.get(row["id"], ()))} for row in merge_adapter_rows(rows)]
        return {"model": names[0], "models": names, "adapters": adapters}

    async def keep_adapter(self, ref: AdapterRef) -> dict:
        index = await run_in_threadpool(self._route, [ref], None)
        handle = self.handles[index].options(multiplexed_model_id=ref.adapter_id)
        return await self._call(lambda: handle.keep_adapter.remote(ref))

    async def evict_adapter(self, ref: AdapterRef) -> None:
        index = await run_in_threadpool(self._route, [ref], None)
        await self._call(lambda: self.reports.evict.remote(self.deployments[index], ref.adapter_id))

    async def replicas(self) -> list[dict]:
        """Every model replica that reported: id, deployment, model, pid, alive, loads, evictions,
        images served, the adapter sets it holds, and where it runs: its torch device, the GPU
        ids Ray gave it, and each visible GPU's name and memory (allocated, peak, total)."""
        reports = await self._call(lambda: self.reports.collect.remote())
        keys = ("replica", "deployment", "model", "pid", "alive", "loads", "evictions", "served", "held",
                "device", "gpu_ids", "visible_devices", "gpus")
        return [{k: r.get(k) for k in keys} for r in sorted(reports, key=lambda r: (r["deployment"], r["replica"]))]

    async def figures(self) -> EngineFigures:
        reports = await self._call(lambda: self.reports.collect.remote())
        total = EngineFigures()
        for report in reports:
            total.add(report["figures"], gauges=report["alive"])
        live = {report["deployment"] for report in reports if report["alive"]}
        total.ready = self.names is not None and live >= set(self.deployments)
        total.replicas = sorted(reports, key=lambda r: (r["deployment"], r["replica"]))
        return total


async def _result(response):
    return await response


class Ingress:
    """The Serve ingress deployment (wrapped by `serve.ingress()` in `cluster.app`)."""

    def __init__(self, config: dict, models: list, reports):
        log_to_stderr()
        config = ClusterConfig.model_validate(config)
        backend = RayBackend(config, models, reports)
        self._app = create_app(config, backend=backend)

        @self._app.get("/replicas", tags=[Access.ADMIN.value], dependencies=[Depends(require_admin_key)])
        async def replicas():
            """The model replicas of this Ray Serve deployment and what each holds."""
            return {"replicas": await backend.replicas()}

    def __serve_build_asgi_app__(self):
        return self._app
