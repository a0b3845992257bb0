"""Adapters at scale on the worker: reads ahead of generation, fairness, budgets, batches.

The scheduling tests wait on events (every read done, so many requests served), and the
fairness bound runs on a clock the test moves, not on the wall clock."""

import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest
from support.numerics import rel_err

from loraswap.adapters.cache import CacheConfig, Tier
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.folder import FolderSource
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker


class SlowSource(FolderSource):
    """A folder whose every lookup takes 0.5 s (a slow disk or network), noting the thread and
    how many lookups ran at once."""

    def __init__(self, root, delay=0.5):
        super().__init__(root)
        self.delay, self.threads = delay, []
        self.running = self.most_at_once = 0
        self._lock = threading.Lock()

    def locate(self, ref):
        with self._lock:
            self.threads.append(threading.current_thread().name)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.delay)
        with self._lock:
            self.running -= 1
        return super().locate(ref)


class ReadsSeen:
    """Stands in for the engine's lender, noting each lease it starts: a test waits until
    every request's adapters are read before the worker starts choosing."""

    def __init__(self, engine):
        self.lender, self.leases = engine.lender, []
        engine.lender = self

    def lease(self, refs, located=None):
        future = self.lender.lease(refs, located)
        self.leases.append(future)
        return future

    def lease_now(self, refs, located=None):
        return self.lender.lease_now(refs, located)

    def wait(self):
        done, pending = wait(self.leases, timeout=60)
        assert not pending, "every read finished"


class Clock:
    """The worker's clock, moved by the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, adapter_factory):
    root = tmp_path_factory.mktemp("many")
    for i in range(40):
        adapter_factory(f"m{i:02d}", "tiny-sd", rank=8, targets="attn", alpha=16.0, seed=200 + i, folder=root)
    return root


def request(adapter_id, seed=0, **kwargs):
    return GenerateRequest(prompt=f"a fox {seed}", seed=seed, steps=2, loras=[(adapter_id, 1.0)] if adapter_id
                           else [], **kwargs)


def test_slow_source_is_read_ahead_and_the_worker_only_swaps(many_adapters):
    source = SlowSource(many_adapters)
    engine = Engine(EngineConfig(model="tiny-sd", source=source, warmup=False, prefetch_threads=8))
    worker = GpuWorker(engine, SchedulerConfig(max_queue=16))
    worker.start()
    futures = [worker.submit(request(f"m{i:02d}", seed=i)) for i in range(8)]
    results = [f.result(timeout=60) for f in futures]
    worker.stop()
    # every read ran on the store's threads, several at once, and none on the GPU worker's
    assert len(source.threads) == 8 and all(name.startswith("loraswap-prefetch") for name in source.threads)
    assert source.most_at_once >= 2, "the reads overlapped"
    # each result says it waited for its read (the source's 0.5 s), and the wait for the worker includes it
    assert all(r.timings["read"] >= 0.8 * source.delay for r in results), [r.timings for r in results]
    assert all(r.timings["wait"] >= r.timings["read"] for r in results), [r.timings for r in results]
    assert all(r.swap_seconds > 0 for r in results), "each request swapped its own adapter in"


def _served_in_order(worker, futures) -> list[int]:
    """Start the worker once every request's adapters are read; the indices in the order served."""
    order = []
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: order.append(i))
    worker.engine.lender.wait()
    worker.start()
    for f in futures:
        f.result(timeout=60)
    worker.stop()
    return order


@pytest.mark.slow  # serves about 40 requests, twice
def test_fairness_bounds_how_often_a_request_is_passed_over(many_adapters):
    engine = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False))
    engine.set_adapters([("m00", 1.0)])
    ReadsSeen(engine)
    worker = GpuWorker(engine, SchedulerConfig(max_queue=64, max_skips=3, max_wait_s=60))
    futures = [worker.submit(request("m00", seed=0))]
    futures.append(worker.submit(request("m01", seed=1)))  # the one that could starve
    futures += [worker.submit(request("m00", seed=i)) for i in range(2, 20)]
    order = _served_in_order(worker, futures)
    # m00 is applied, so m00 requests are preferred; the m01 request may be passed over 3 times
    assert order.index(1) <= 1 + 3, order
    assert order.index(1) >= 2, "affinity did prefer the applied adapter"
    # and without the bound it would have waited for all 19
    engine2 = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False))
    engine2.set_adapters([("m00", 1.0)])
    ReadsSeen(engine2)
    unfair = GpuWorker(engine2, SchedulerConfig(max_queue=64, max_skips=1000, max_wait_s=600))
    futures = [unfair.submit(request("m00", seed=0)), unfair.submit(request("m01", seed=1))]
    futures += [unfair.submit(request("m00", seed=i)) for i in range(2, 20)]
    assert _served_in_order(unfair, futures).index(1) == 19


@pytest.mark.slow  # serves a stream of requests
def test_fairness_in_time_under_a_stream_of_the_applied_adapter(many_adapters):
    engine = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False))
    engine.set_adapters([("m00", 1.0)])
    ReadsSeen(engine)
    clock = Clock()
    worker = GpuWorker(engine, SchedulerConfig(max_queue=64, max_skips=1000, max_wait_s=10), clock)
    served, stop = [], threading.Event()
    enough = threading.Event()  # so many m00 requests served since the worker started

    def submit(adapter_id, seed):
        future = worker.submit(request(adapter_id, seed=seed))
        future.add_done_callback(lambda _: done(adapter_id))
        return future

    def done(adapter_id):
        served.append(adapter_id)
        if served.count("m00") >= 8:
            enough.set()

    def stream():  # requests for the applied adapter keep coming
        while not stop.is_set():
            if worker.queue_depth < 30:
                submit("m00", 1)
            time.sleep(0.005)

    submit("m00", 1)
    other = submit("m02", 2)
    for _ in range(30):  # read before the worker starts: a ready m00 request is always waiting
        submit("m00", 1)
    engine.lender.wait()
    worker.start()
    feeder = threading.Thread(target=stream)
    feeder.start()
    try:
        assert enough.wait(60)
        assert not other.done(), "within its bound, the applied adapter's requests go first"
        at_bound = len(served)
        clock.now = 10.0  # the other request's bound passes
        other.result(timeout=60)
    finally:
        stop.set()
        feeder.join()
        worker.stop()
    # once overdue it goes next: after at most the one image then in progress
    assert served[at_bound:].index("m02") <= 1, served[at_bound:]


@pytest.mark.load  # 32 clients at once
def test_32_threads_40_adapters_through_a_10_adapter_budget(many_adapters):
    probe = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False))
    size = probe.adapters.read(AdapterRef("m00")).nbytes
    budget = 10 * size
    engine = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False,
                                 cache=CacheConfig(host_bytes=budget, gpu_bytes=0)))
    worker = GpuWorker(engine, SchedulerConfig(max_queue=64))
    worker.start()
    results, errors = {}, []

    def client(t):
        for k in range(2):
            adapter_id, seed = f"m{(t * 7 + k * 13) % 40:02d}", t * 10 + k
            try:
                results[(adapter_id, seed)] = worker.submit(request(adapter_id, seed=seed)).result(timeout=120)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(t,)) for t in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker.stop()
    assert errors == []
    assert len(results) == 64
    assert engine.adapters.cache.peak_bytes["host"] <= budget
    assert engine.adapters.cache.used(Tier.HOST) <= budget
    assert len({aid for aid, _ in results}) > 10, "more adapters than the budget holds"
    for (adapter_id, seed), result in results.items():
        alone = probe.generate(request(adapter_id, seed=seed))
        assert np.array_equal(np.asarray(result.image), np.asarray(alone.image)), (adapter_id, seed)


def test_identical_adapter_requests_are_batched(many_adapters):
    engine = Engine(EngineConfig(model="tiny-sd", adapters=many_adapters, warmup=False))
    ReadsSeen(engine)
    worker = GpuWorker(engine, SchedulerConfig(max_queue=16, max_batch=4))
    futures = [worker.submit(request("m05", seed=s)) for s in range(4)]
    futures.append(worker.submit(request("m05", seed=9, width=32, height=32)))  # other parameters
    _served_in_order(worker, futures)
    results = [f.result() for f in futures]
    assert worker.batches == 2 and worker.completed == 5
    assert results[4].image.size == (32, 32)
    for seed, result in enumerate(results[:4]):
        alone = engine.generate(request("m05", seed=seed))
        assert rel_err(np.asarray(result.image, dtype=float), np.asarray(alone.image, dtype=float)) < 5e-3
        assert result.seed == seed
