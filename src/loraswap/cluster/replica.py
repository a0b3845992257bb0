"""A model replica: one engine (one GPU, or the CPU) and its GPU worker, in a Ray Serve replica.

The adapter set of a request (`a` or, for a blend, `a,b`) is its Ray Serve multiplexed
model id. `serve.multiplexed` keeps up to `max_adapters` of them per replica, least
recently used first out, and tells Serve's router which replica holds which, so among
replicas equally busy the next request for an adapter goes to one that already has it
(`request_router.py`; a less busy replica loads it too). Loading one (`AdapterBudget`) reads the
adapters into the engine's cache (`engine.adapters.read_ahead`) with the refs of the request
that asked for it (URLs and all); evicting one drops them from the cache unless kept or still
used by another held set.

The replica reports its figures, cache table and held sets to `Reports`, and does the
commands it gets back (evict an adapter, for `DELETE /adapters/{id}`).
"""

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar

import ray
import torch
from ray import serve

from loraswap.adapters.reference import AdapterRef
from loraswap.cluster.config import ModelDeploymentConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine, GenerateResult
from loraswap.engine.parallel.processes import RankProcesses
from loraswap.engine.process import freeze_loaded_objects
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker
from loraswap.server.metrics import EngineFigures, gpu_memory

logger = logging.getLogger("loraswap.cluster")

# the refs of the call whose `_load` runs the loader: Serve awaits the loader inside that call's
# `_load`, in that call's context, so the loader reads this call's refs (URLs and all) and no
# other call's, whichever request fails or whichever held set is evicted meanwhile
_holding: ContextVar[tuple[AdapterRef, ...]] = ContextVar("loraswap_holding", default=())


def log_to_stderr() -> None:
    """loraswap's own log lines in a Ray worker (Ray streams its stderr to the driver)."""
    root = logging.getLogger("loraswap")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def adapter_key(refs: list[AdapterRef]) -> str:
    """The multiplexed model id of a request: its adapter ids, sorted, comma-joined ('' for none)."""
    return ",".join(sorted(ref.adapter_id for ref in refs))


def _gpu_names() -> dict[str, dict]:
    """Each visible GPU's name and memory, by device index (they do not change: read once)."""
    if not torch.cuda.is_available():
        return {}
    properties = (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
    return {str(i): {"name": p.name, "total_bytes": p.total_memory} for i, p in enumerate(properties)}


class _Held:
    """An adapter set held in the budget; Serve calls `__del__` when it evicts it."""

    def __init__(self, budget: "AdapterBudget", key: str):
        self.budget, self.key, self._released = budget, key, False

    def __del__(self):  # called by Serve's LRU (in a thread), and again by the GC: once only
        if not self._released:
            self._released = True
            self.budget.drop(self.key)


class AdapterBudget:
    """The adapter sets a replica holds, by multiplexed id. `multiplexed` turns the loader of a
    set into the call that holds it: `serve.multiplexed`, which keeps the sets least recently
    used first out and calls a set's `__del__` when it evicts it. Loading a set reads its
    adapters into the engine's cache (`adapters`: the engine's `AdapterStore`) with the refs of
    the request that asked for it; dropping one evicts those no other held set names (unless kept)."""

    def __init__(self, adapters, multiplexed: Callable, name: str, on_load: Callable[[], None] = lambda: None):
        self.adapters = adapters
        self.name = name  # the replica's, for the logs
        self._on_load = on_load
        self._held: dict[str, tuple[str, ...]] = {}  # key -> adapter ids
        self._refs: Counter = Counter()  # adapter id -> held keys naming it
        self._lock = threading.Lock()
        self.loads = self.evictions = 0
        self._load = multiplexed(self._loader())

    @property
    def held(self) -> dict[str, tuple[str, ...]]:
        """The sets held now: multiplexed id -> its adapter ids, in the order they were loaded."""
        with self._lock:
            return dict(self._held)

    async def hold(self, key: str, refs: list[AdapterRef]) -> None:
        """Hold the adapter set `key` (these refs'): read by its loader, with these refs, unless held."""
        token = _holding.set(tuple(refs))
        try:
            await self._load(key)
        finally:
            _holding.reset(token)

    def _loader(self):
        async def load_adapters(key: str) -> _Held:
            ids = tuple(key.split(","))
            refs = _holding.get()
            if adapter_key(list(refs)) != key:  # no call's refs: the ids alone (a URL's from the download folder)
                refs = tuple(AdapterRef(adapter_id) for adapter_id in ids)
            await asyncio.wrap_future(self.adapters.read_ahead(list(refs)))
            with self._lock:
                self._held[key] = ids
                self._refs.update(ids)
                self.loads += 1
                held = len(self._held)
            logger.info("replica %s holds %s (%d held)", self.name, key, held)
            self._on_load()
            return _Held(self, key)

        return load_adapters

    def drop(self, key: str) -> None:
        """Let the set go (Serve evicted it): its adapters leave the cache unless kept, named by
        another held set, or held by a queued request."""
        with self._lock:
            ids = self._held.pop(key, ())
            self._refs.subtract(ids)
            unused = [a for a in ids if self._refs[a] <= 0]
            self.evictions += 1
        cache = self.adapters.cache
        for adapter_id in unused:
            entry = cache.get(adapter_id)
            if entry is not None and not entry.kept:
                cache.evict(adapter_id)  # drops it unless a queued request holds it
        logger.info("replica %s evicted %s (least recently used)", self.name, key)


class ModelReplica:
    async def __init__(self, config: dict, scheduler: dict, reports, report_interval_s: float):
        # 1. the engine (warm, compiled when on CUDA) and its GPU worker thread
        log_to_stderr()
        self.config = config = ModelDeploymentConfig.model_validate(config)
        scheduler = SchedulerConfig.model_validate(scheduler)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        # with context parallelism this replica is rank 0 of its own processes, one per GPU it holds;
        # started from this (lasting) thread: a child dies with the thread that started it
        self._ranks = RankProcesses(config) if config.parallel.parallelism.world > 1 else None
        self.engine = await asyncio.to_thread(self._ranks.engine_factory if self._ranks else Engine, config)
        self.worker = GpuWorker(self.engine, scheduler)
        self.worker.start()
        freeze_loaded_objects()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.deployment = context.deployment
        # 2. the adapter budget: Ray Serve multiplexing, sized per deployment; a set loaded is reported at once
        self._wake = asyncio.Event()
        multiplexed = serve.multiplexed(max_num_models_per_replica=config.max_adapters)
        self.budget = AdapterBudget(self.engine.adapters, multiplexed, self.replica_id, on_load=self._wake.set)
        self.served = 0
        # 3. reports
        self._reports = reports
        self._interval_s = report_interval_s
        self._seq = itertools.count(1)
        self._stopping = False
        self._gpu_names = _gpu_names()
        self._placement = self._where()  # fixed for the replica's life
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
        logger.info("replica %s of %s ready (%s)", self.replica_id, self.deployment, self.engine.model_name)

    # ---------------------------------------------------------------- requests
    async def info(self) -> dict:
        family = self.engine.calls.family
        return {"model": self.engine.model_name, "compiled": self.engine.compiled, "replica": self.replica_id,
                "capabilities": self.engine.capabilities(), "family": family.name if family else None}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The request's adapter refs came with it, URLs and all (this replica's node may have to
        fetch them into its own download folder)."""
        request = self.engine.calls.sized(request)  # beyond the model's largest size: 400 before anything is held
        request = self.engine.step_cache.resolved(request)  # and a step cache it cannot take
        # 1. hold the request's adapters in this replica's budget (Serve routed it here for them)
        received = time.perf_counter()
        key = serve.get_multiplexed_model_id()
        if key:
            await self.budget.hold(key, request.loras)
        held = time.perf_counter()
        # 2. queue for the GPU worker (adapters from the cache); a cancelled request is dropped
        future = self.worker.submit(request)
        result = await asyncio.wrap_future(future)
        self.served += 1
        result.timings |= {"hold": held - received, "replica": time.perf_counter() - received}
        return result

    async def keep_adapter(self, ref: AdapterRef) -> dict:
        """Hold the adapter here, read it now and keep it in the cache (POST /adapters/{id}/load)."""
        await self.budget.hold(ref.adapter_id, [ref])
        bound = await asyncio.to_thread(self.engine.keep_adapter, ref)
        await self._report()
        return {"bytes": bound.nbytes, "layers": len(bound.layers), "model": self.engine.model_name,
                "replica": self.replica_id}

    async def __del__(self):
        """Graceful stop (Serve has drained requests): finish the queue, report a last time."""
        self._stopping = True
        self._reporter.cancel()
        await asyncio.to_thread(self.worker.stop, 60.0)
        if self._ranks is not None:
            await asyncio.to_thread(self._ranks.stop)
        self.engine.adapters.close()
        try:  # `reports` may be stopping too (the whole app is): do not wait on it
            await asyncio.wait_for(self._report(stopped=True), timeout=2.0)
        except (Exception, asyncio.TimeoutError):
            logger.debug("last report of %s not delivered", self.replica_id)

    # ---------------------------------------------------------------- commands
    def _evict(self, adapter_id: str) -> None:
        """Stop keeping it and drop it (DELETE /adapters/{id}); it is read anew when next used."""
        self.engine.evict_adapter(AdapterRef(adapter_id), download_too=False)  # (an id the ingress checked)

    # ---------------------------------------------------------------- reports
    def _snapshot(self, stopped: bool = False) -> dict:
        engine = self.engine
        cache = engine.adapters.rows(engine.applied_ids, cached_only=True)
        budget = self.budget
        figures = EngineFigures.of(engine, self.worker)
        figures.ready = not stopped
        return {"replica": self.replica_id, "deployment": self.deployment, "model": engine.model_name,
                "seq": next(self._seq), "pid": os.getpid(), "loads": budget.loads, "evictions": budget.evictions,
                "served": self.served, "held": list(budget.held), "cache": cache, "figures": figures, **self._placement,
                "gpus": [{**row, **self._gpu_names.get(row["device"], {})} for row in gpu_memory()]}

    def _where(self) -> dict:
        """Where the engine runs: its torch device and the cluster's GPU ids Ray gave this
        replica (what CUDA_VISIBLE_DEVICES maps to cuda:0, cuda:1, ... in this process)."""
        return {"device": str(self.engine.device), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    async def _report(self, done: list[int] | None = None, stopped: bool = False) -> list:
        return await self._reports.put.remote(self._snapshot(stopped), done or [], stopped)

    async def _report_loop(self) -> None:
        done: list[int] = []
        while not self._stopping:
            try:
                commands = await self._report(done)
                done = []
                for command, verb, adapter_id in commands:
                    if verb == "evict":
                        await asyncio.to_thread(self._evict, adapter_id)
                    done.append(command)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("replica %s could not report", self.replica_id, exc_info=True)
            if done:
                continue  # report the commands done at once
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
