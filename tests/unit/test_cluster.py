"""The Ray Serve deployment's parts that need no cluster: config files, the reports protocol,
multiplexed ids, GPUs per replica, errors crossing processes. (tests/integration/test_ray.py
runs the real thing.)"""

import asyncio
import pickle
from collections import OrderedDict, defaultdict, deque
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.cluster.app import build_app, load_config, replica_gpus
from loraswap.cluster.config import ClusterConfig, ModelDeploymentConfig
from loraswap.cluster.ingress import RayBackend
from loraswap.cluster.replica import AdapterBudget, adapter_key
from loraswap.cluster.reports import Reports
from loraswap.cluster.request_router import LeastBusyAdapterRouter
from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import AdapterIncompatible, AdapterNotFound, BadRequest, Overloaded
from loraswap.server.metrics import EngineFigures

EXAMPLES = Path(__file__).parents[2] / "examples" / "ray"


def test_example_config_files_load():
    config = load_config(EXAMPLES / "loraswap.yaml")
    assert [(e.model, e.replicas, e.max_adapters) for e in config.engines] == [
        ("stabilityai/stable-diffusion-xl-base-1.0", 4, 64), ("black-forest-labs/FLUX.1-dev", 2, 16)]
    assert config.engines[0].deployment_name == "model-stabilityai_stable-diffusion-xl-base-1.0"
    assert config.engines[0].cache.gpu_bytes == 4 * 2**30 and config.scheduler.max_queue == 64
    assert (config.host, config.port, config.max_width) == ("0.0.0.0", 8888, 1536)


def test_configs_travel_as_json_and_come_back_equal():
    """build_app hands replicas JSON-like dicts, validated again there (robust to version skew)."""
    config = load_config(EXAMPLES / "loraswap.yaml")
    assert ClusterConfig.model_validate(config.model_dump(mode="json")) == config
    engine = config.engines[1]
    assert ModelDeploymentConfig.model_validate(engine.model_dump(mode="json")) == engine
    older = engine.model_dump(mode="json")
    del older["swap"]["max_rank"]  # a field it lacked
    assert ModelDeploymentConfig.model_validate(older).swap.max_rank == ModelDeploymentConfig().swap.max_rank


def test_kuberay_serve_config_is_a_cluster_config(tmp_path):
    service = yaml.safe_load((EXAMPLES / "rayservice.yaml").read_text())
    serve_config = tmp_path / "serve.yaml"
    serve_config.write_text(service["spec"]["serveConfigV2"])
    config = load_config(serve_config)
    assert config.port == 8000 and config.app_name == "loraswap" and config.report_interval_s == 1.0
    assert config.engines[0].num_gpus == 1 and config.engines[0].replicas == 4


def test_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="share a deployment name"):
        ClusterConfig(engines=[ModelDeploymentConfig(model="tiny-sd"), ModelDeploymentConfig(model="tiny-sd")])
    ClusterConfig(engines=[ModelDeploymentConfig(model="tiny-sd"), ModelDeploymentConfig(model="tiny-sd", name="b")])
    with pytest.raises(ValueError, match="replicas"):
        ModelDeploymentConfig(replicas=0)
    two_apps = tmp_path / "two.yaml"
    two_apps.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "other:app"}]}))
    with pytest.raises(ValueError, match="exactly one application"):
        load_config(two_apps)


def test_multiplexed_id_is_the_adapter_set():
    assert adapter_key([]) == ""
    assert adapter_key(as_refs([("style", 1.0)])) == "style"
    assert adapter_key(as_refs([("b", 0.3), ("a", 0.8)])) == adapter_key(as_refs([("a", 0.1), ("b", 1.0)])) == "a,b"


class ServeBudget:
    """What `serve.multiplexed` does with a replica's loader (ray/serve/multiplex.py): the sets it
    holds, least recently used first out; loads one at a time under one lock; a full budget unloads
    the oldest set first, calling its `__del__` in a thread, which may start after another request
    came in."""

    def __init__(self, loader, max_sets: int):
        self.loader, self.max_sets = loader, max_sets
        self.sets: OrderedDict = OrderedDict()
        self.lock = asyncio.Lock()

    async def __call__(self, key: str):
        if key in self.sets:
            self.sets.move_to_end(key)
            return self.sets[key]
        async with self.lock:
            if key in self.sets:
                return self.sets[key]
            if len(self.sets) >= self.max_sets:
                _, held = self.sets.popitem(last=False)
                await asyncio.sleep(0)  # the thread starts late
                await asyncio.get_running_loop().run_in_executor(None, held.__del__)
            self.sets[key] = await self.loader(key)
            return self.sets[key]


class ReadingAhead:
    """An engine's adapters as a replica's loader reads them: each `read_ahead` records the refs
    it got and answers the next of `answers` (a Future the test settles, or done at once)."""

    def __init__(self):
        self.read, self.answers = [], deque()
        self.cache = SimpleNamespace(get=lambda adapter_id: None)

    def read_ahead(self, refs) -> Future:
        self.read.append(list(refs))
        if self.answers:
            return self.answers.popleft()
        done = Future()
        done.set_result(None)
        return done


def bare_budget(max_sets: int) -> AdapterBudget:
    """A replica's adapter budget without a running Serve: `ServeBudget` over its loader."""
    return AdapterBudget(ReadingAhead(), lambda loader: ServeBudget(loader, max_sets), "r1")


URL = "https://cdn.example.com/held.safetensors?X-Signature=SECRET"


def urls_read(budget) -> list[dict]:
    return [{ref.adapter_id: ref.url for ref in refs} for refs in budget.adapters.read]


def test_a_replica_reads_a_set_with_the_refs_of_the_request_it_loads_for_whatever_fails_or_goes_meanwhile():
    """A request's `url:` ref keeps its URL to the read, though the same set was evicted while the
    request waited for the budget, or another request for it failed meanwhile."""
    sent = pickle.loads(pickle.dumps(GenerateRequest(prompt="x", loras=[AdapterRef.named(URL)])))  # as Ray sends it
    [ref] = sent.loras
    key = ref.adapter_id
    assert ref.url == URL and adapter_key(sent.loras) == key, "the URL goes to the replica inside the ref"

    async def evicted_meanwhile():
        budget = bare_budget(max_sets=1)
        await budget.hold(key, [ref])  # held, then the oldest when "other" comes
        other = asyncio.create_task(budget.hold("other", [AdapterRef("other")]))
        again = asyncio.create_task(budget.hold(key, [ref]))  # comes while `key` is unloaded
        await asyncio.gather(other, again)
        assert urls_read(budget) == [{key: URL}, {"other": None}, {key: URL}]
        assert budget.held == {key: (key,)} and budget.evictions == 2

    async def another_failed_meanwhile():
        budget = bare_budget(max_sets=4)
        first_read = Future()
        budget.adapters.answers.append(first_read)
        failing = asyncio.create_task(budget.hold(key, [ref]))
        await asyncio.sleep(0.05)  # its read has begun
        waiting = asyncio.create_task(budget.hold(key, [ref]))
        await asyncio.sleep(0.05)  # waits for the budget's lock
        first_read.set_exception(OSError("the first read failed"))
        with pytest.raises(OSError):
            await failing
        await waiting
        assert urls_read(budget) == [{key: URL}, {key: URL}], "the second read still has the URL"
        assert list(budget.held) == [key]

    asyncio.run(evicted_meanwhile())
    asyncio.run(another_failed_meanwhile())


def bare_router() -> LeastBusyAdapterRouter:
    """The router's state without a running Serve: what ranking and fulfilling read."""
    router = object.__new__(LeastBusyAdapterRouter)
    router._multiplexed_model_id_to_replica_ids = {"a,b": {"r3"}}
    router._pending_requests_by_id, router._pending_requests_by_model_id = {}, defaultdict(deque)
    router._pending_requests_to_fulfill = deque()
    router._routing_task_by_pending_request_future = {}
    router.queue_wait_time_ms_histogram = SimpleNamespace(observe=lambda ms: None)
    return router


def waiting(request_id: str, model_id: str) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=request_id, multiplexed_model_id=model_id),
                           routing_context=SimpleNamespace(should_backoff=False),
                           future=asyncio.get_running_loop().create_future(), created_at=0.0)


def test_replicas_are_ranked_least_busy_first_by_serve_holders_breaking_ties():
    """Serve probes the queue lengths of the list it gets and takes the shortest, the first of
    equals: the router lists every replica, those holding the request's adapters first, then
    those holding fewer adapter sets."""
    router = bare_router()
    replicas = [SimpleNamespace(replica_id=name, multiplexed_model_ids=set(held))
                for name, held in (("r1", ["x", "y"]), ("r2", ["z"]), ("r3", ["a,b", "x", "y"]))]

    async def ranked(model_id):
        request = waiting("q", model_id)
        lists = await router.choose_replicas(replicas, request)
        assert len(lists) == 1, "one list: Serve then takes the least busy of all"
        assert request.routing_context.should_backoff, "every replica was asked: wait before asking again"
        return [r.replica_id for r in lists[0]]

    assert asyncio.run(ranked("a,b")) == ["r3", "r2", "r1"]
    assert asyncio.run(ranked("new")) == ["r2", "r1", "r3"]
    assert asyncio.run(ranked("")) == ["r2", "r1", "r3"]


def test_a_free_slot_goes_to_the_oldest_waiting_request_and_nothing_is_kept_by_model_id():
    async def fulfil():
        router = bare_router()
        old, new = waiting("old", "a"), waiting("new", "b")
        for request in (old, new):
            router._pending_requests_to_fulfill.append(request)
            router._add_pending_request_to_indices(request)
        assert dict(router._pending_requests_by_model_id) == {}, "filed by id only: nothing to leak"
        # the routing task of the newer request found a free slot: the older request takes it
        router._fulfill_next_pending_request("replica-1", new.metadata)
        assert old.future.done() and old.future.result() == "replica-1" and not new.future.done()
        assert list(router._pending_requests_by_id) == ["new"]

    asyncio.run(fulfil())


def test_model_deployments_take_what_their_worker_holds_and_route_least_busy():
    config = ClusterConfig(scheduler={"max_queue": 20, "max_batch": 2},
                           engines=[ModelDeploymentConfig(model="tiny-sd"),
                                    ModelDeploymentConfig(model="tiny-sdxl", max_ongoing_requests=3)])
    # the ingress is bound with (config, model deployments, reports)
    deployments = [model._bound_deployment for model in build_app(config)._bound_deployment.init_args[1]]
    assert [d.max_ongoing_requests for d in deployments] == [21, 3]  # max_queue + the one generating, or as set
    assert [d.max_queued_requests for d in deployments] == [20, 20]
    routers = [d._deployment_config.request_router_config.request_router_class for d in deployments]
    assert all("LeastBusyAdapterRouter" in str(r) for r in routers), routers


def test_gpus_per_replica():
    assert replica_gpus(ModelDeploymentConfig(device="cuda")) == 1
    assert replica_gpus(ModelDeploymentConfig(device="cpu")) == 0
    assert replica_gpus(ModelDeploymentConfig(device="auto")) == 0  # no Ray cluster with GPUs here
    assert replica_gpus(ModelDeploymentConfig(device="cuda", num_gpus=0.5)) == 0.5


def test_adapter_errors_keep_status_and_message_across_processes():
    for error in (AdapterIncompatible("a", "it was made for sdxl", "Use an SD adapter"),
                  AdapterNotFound("b", "no such adapter", "GET /adapters"), BadRequest("the prompt is empty")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and copy.status == error.status and copy.message == error.message


def report(replica, seq, deployment="model-tiny-sd", misses=0, depth=0, cache=()):
    return {"replica": replica, "deployment": deployment, "model": "tiny-sd", "seq": seq, "pid": 1, "loads": seq,
            "evictions": 0, "served": 0, "held": [], "cache": list(cache),
            "figures": EngineFigures(cache_misses=misses, queue_depth=depth, ready=True)}


def test_reports_keep_the_newest_and_stop_counting_gauges_of_the_gone(monkeypatch):
    from loraswap.cluster import reports as module

    now = 1000.0  # the reports' clock only
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: now))

    async def scenario():
        nonlocal now
        reports = Reports(interval_s=0.05)
        await reports.put(report("r1", 2, misses=5, depth=3), [])
        await reports.put(report("r1", 1, misses=1), [])  # an older report arriving late is ignored
        await reports.put(report("r2", 1, misses=2, depth=1, cache=[{"id": "a"}]), [])
        await reports.put(report("r2", 2, misses=2), [], stopped=True)
        rows = {r["replica"]: r for r in await reports.collect()}
        assert rows["r1"]["seq"] == 2 and rows["r1"]["alive"] and rows["r1"]["figures"].cache_misses == 5
        assert not rows["r2"]["alive"] and rows["r2"]["cache"] == []
        total = EngineFigures()
        for row in rows.values():
            total.add(row["figures"], gauges=row["alive"])
        assert total.cache_misses == 7, "counters of a stopped replica still count"
        assert total.queue_depth == 3, "its gauges do not"
        now += 2.9  # since r1's last report
        alive = lambda rows: {r["replica"]: r["alive"] for r in rows}  # noqa: E731
        assert alive(await reports.collect()) == {"r1": True, "r2": False}, "2.9 s: still there"
        now += 0.2  # no report for longer than max(4 intervals, 3 s): gone
        assert alive(await reports.collect()) == {"r1": False, "r2": False}

    asyncio.run(scenario())


def test_reports_evict_reaches_every_live_replica_of_the_deployment():
    async def scenario():
        reports = Reports(interval_s=0.05)
        for replica, deployment in (("r1", "model-tiny-sd"), ("r2", "model-tiny-sd"), ("x1", "model-tiny-sdxl")):
            await reports.put(report(replica, 1, deployment), [])
        done = {}

        async def replica_loop(replica, deployment):  # what a replica's report loop does
            seq, finished = 2, []
            while True:
                commands = await reports.put(report(replica, seq, deployment), finished)
                seq += 1
                finished = [command for command, verb, adapter_id in commands if verb == "evict"]
                for command, _, adapter_id in commands:
                    done.setdefault(replica, []).append(adapter_id)
                await asyncio.sleep(0.05)

        loops = [asyncio.create_task(replica_loop(r, d))
                 for r, d in (("r1", "model-tiny-sd"), ("r2", "model-tiny-sd"), ("x1", "model-tiny-sdxl"))]
        evicted = await asyncio.wait_for(reports.evict("model-tiny-sd", "style"), 5)
        for loop in loops:
            loop.cancel()
        assert evicted == 2 and done == {"r1": ["style"], "r2": ["style"]}
        assert await reports.evict("model-nothing", "style") == 0

    asyncio.run(scenario())


class FakeHandle:
    """A deployment handle whose calls fail with the given errors, then answer `result`."""

    def __init__(self, *errors):
        self.errors, self.calls, self.ids, self.requests = list(errors), 0, [], []
        self.generate = self

    def options(self, multiplexed_model_id=""):
        self.ids.append(multiplexed_model_id)
        return self

    def remote(self, request):
        self.calls += 1
        self.requests.append(pickle.loads(pickle.dumps(request)))  # as Ray sends it to the replica
        error = self.errors.pop(0) if self.errors else None
        return FakeResponse(error)


class FakeResponse:
    def __init__(self, error):
        self.error = error

    def __await__(self):
        if self.error is not None:
            raise self.error
        yield from asyncio.sleep(0.2).__await__()  # the call takes 0.2 s, of which the replica spent 0.15 s
        return GenerateResult("an image", 1, 0.0, 0.0, timings={"hold": 0.0, "replica": 0.15})

    def cancel(self):
        pass


def ingress_over(handle, tmp_path) -> RayBackend:
    (tmp_path / "style.safetensors").write_bytes(b"")  # located, never read: one model is hosted
    backend = RayBackend(ClusterConfig(engines=[ModelDeploymentConfig(adapters=tmp_path)]), [handle], reports=None)
    backend.names = ["tiny-sd"]
    return backend


async def never_gone():
    return False


def test_ingress_sends_a_request_again_when_its_replica_died(tmp_path):
    handle = FakeHandle(ActorDiedError(), ActorDiedError())
    request = GenerateRequest(prompt="x", loras=[("style", 0.5)])
    result = asyncio.run(ingress_over(handle, tmp_path).generate(request, None, never_gone))
    assert result.image == "an image"
    assert set(result.timings) == {"hold", "ray"}
    # Serve's share: the call's 0.2 s less the replica's own 0.15 s (the two failed attempts and
    # the 0.2 s and 0.4 s waits between them count too: a dying replica costs the client that)
    assert 0.2 + 0.6 - 0.15 <= result.timings["ray"] < 0.2 + 0.6 - 0.15 + 0.1, result.timings
    assert handle.calls == 3 and handle.ids == ["style"], "the adapter set is the multiplexed model id"
    handle = FakeHandle(ActorDiedError(), ActorDiedError(), ActorDiedError())
    with pytest.raises(Overloaded, match="went away"):
        asyncio.run(ingress_over(handle, tmp_path).generate(request, None, never_gone))


def test_ingress_hands_the_replica_the_urls_behind_url_ids(tmp_path):
    """A replica on another node must fetch a `url:` adapter itself: only the ingress saw its URL,
    which goes inside the request's ref."""
    url = "https://cdn.example.com/handed-over.safetensors?X-Signature=SECRET"
    url_id = AdapterRef.named(url).adapter_id
    handle = FakeHandle()
    backend = ingress_over(handle, tmp_path)
    backend.source = SimpleNamespace(locate=lambda ref: None)  # locating fetches the file; here what is sent matters
    asyncio.run(backend.generate(GenerateRequest(prompt="x", loras=[AdapterRef.named(url), ("style", 0.5)]), None,
                                 never_gone))
    [sent] = handle.requests
    assert {ref.adapter_id: ref.url for ref in sent.loras} == {url_id: url, "style": None}, \
        "the URL of the url: id, and nothing for a folder id"


def test_ingress_answers_replica_errors_as_its_own(tmp_path):
    request = GenerateRequest(prompt="x", loras=[("style", 1.0)])
    refused = AdapterIncompatible("style", "it was made for tiny-flux", "Use another")
    with pytest.raises(AdapterIncompatible) as raised:
        asyncio.run(ingress_over(FakeHandle(RayTaskError("generate", "tb", refused)), tmp_path)
                    .generate(request, None, never_gone))
    assert raised.value.status == 422 and "tiny-flux" in raised.value.message
    with pytest.raises(Overloaded, match="queue is full"):
        asyncio.run(ingress_over(FakeHandle(BackPressureError(num_queued_requests=32, max_queued_requests=32)),
                                 tmp_path).generate(request, None, never_gone))
    with pytest.raises(AdapterNotFound):
        asyncio.run(ingress_over(FakeHandle(), tmp_path).generate(GenerateRequest(prompt="x", loras=[("nope", 1)]),
                                                                   None, never_gone))


class FakeReports:
    """The `reports` deployment's handle: `collect` answers these replica reports."""

    def __init__(self, reports):
        self.reports = reports
        self.collect = self

    def remote(self):
        return FakeAnswer(self.reports)


class FakeAnswer(FakeResponse):
    def __init__(self, value):
        super().__init__(None)
        self.value = value

    def __await__(self):
        return self.value
        yield


def cached(adapter_id, tier="host", kept=False, applied=False):
    return {"id": adapter_id, "cached": tier, "kept": kept, "applied": applied, "base_model": "tiny-sd", "rank": 4,
            "bytes": 1000, "layers": 2}


def test_ingress_lists_every_adapter_a_replica_caches_hub_ones_too(tmp_path):
    backend = ingress_over(FakeHandle(), tmp_path)  # the folder holds "style"
    live = report("r1", 1, cache=[cached("owner/hub-lora", kept=True), cached("style", "gpu", applied=True)])
    other = report("r2", 1, cache=[cached("style", "host", kept=True)])
    gone = {**report("r3", 1, cache=[cached("owner/gone")]), "alive": False}
    backend.reports = FakeReports([{**live, "alive": True}, {**other, "alive": True}, gone])
    listed = asyncio.run(backend.list_adapters())
    rows = {row["id"]: row for row in listed["adapters"]}
    assert set(rows) == {"owner/hub-lora", "style"}, "a kept hub adapter is listed; a gone replica's is not"
    assert rows["owner/hub-lora"] == {**cached("owner/hub-lora", kept=True), "model": "tiny-sd",
                                      "replicas": ["r1"]}
    assert rows["style"] == {**cached("style", "gpu", kept=True, applied=True), "model": "tiny-sd",
                             "replicas": ["r1", "r2"]}
    backend.reports = FakeReports([])
    assert asyncio.run(backend.list_adapters())["adapters"] == [
        {"id": "style", "cached": "disk", "kept": False, "applied": False, "model": None, "replicas": []}]


def test_each_replicas_gpu_is_listed_and_its_memory_in_metrics(tmp_path):
    """On a GPU cluster the ingress sees no GPU (Ray hides them from actors that asked for none):
    the GPU figures are the replicas' own, reported with where each runs."""
    from loraswap.server.metrics import Metrics

    gpu = {"device": "0", "allocated_bytes": 7 * 2**30, "peak_bytes": 9 * 2**30, "name": "NVIDIA H200",
           "total_bytes": 140 * 2**30}
    placed = {"device": "cuda:0", "gpu_ids": ["3"], "visible_devices": "3", "gpus": [gpu]}
    live = {**report("r1", 1), **placed, "alive": True}
    gone = {**report("r2", 1), **placed, "gpu_ids": ["5"], "visible_devices": "5", "alive": False}
    backend = ingress_over(FakeHandle(), tmp_path)
    backend.reports = FakeReports([live, gone])
    rows = {row["replica"]: row for row in asyncio.run(backend.replicas())}
    assert rows["r1"]["device"] == "cuda:0" and rows["r1"]["gpu_ids"] == ["3"] and rows["r1"]["gpus"] == [gpu]
    backend.names = ["tiny-sd"]
    text = Metrics().render(asyncio.run(backend.figures())).decode()
    assert 'loraswap_replica_gpu_memory_peak_bytes{device="0",model="tiny-sd",replica="r1"} 9.663676416e+09' in text
    assert 'loraswap_replica_gpu_memory_bytes{device="0",model="tiny-sd",replica="r1"}' in text
    assert 'replica="r2",' not in text.split("loraswap_replica_gpu_memory_bytes", 1)[1], "a gone replica's is freed"
