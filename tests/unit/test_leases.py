"""Leases: the store lends a request's adapters and the GPU worker alone gives them back,
once, however the request ends (served, failed, cancelled while queued, refused)."""

import threading
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

import pytest
from PIL import Image
from support.fakes import SteppingEngine

from loraswap.adapters.lease import Lease
from loraswap.adapters.reference import as_refs
from loraswap.engine.calls import Stopped
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import Engine, GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker
from loraswap.errors import AdapterNotFound, Overloaded


@dataclass(frozen=True)
class Item:
    adapter_id: str


class CountingLender:
    """Lends one item per adapter and counts what is lent and given back; `missing` is never found."""

    def __init__(self):
        self.lent, self.returned = [], []
        self._lock = threading.Lock()

    def lease(self, refs, located=None) -> Future:
        future: Future = Future()
        if any(ref.adapter_id == "missing" for ref in refs):
            future.set_exception(AdapterNotFound("missing", "no such adapter", "Check the id"))
            return future
        items = [(Item(ref.adapter_id), ref.scale) for ref in refs]
        with self._lock:
            self.lent += [item for item, _ in items]
        future.set_result(Lease(items, self._give_back))
        return future

    def _give_back(self, item) -> None:
        with self._lock:
            self.returned.append(item)


class FakeEngine:
    """Generates at once, or when `gate` opens for a prompt "wait"; fails a prompt "boom"."""

    applied_ids = ()
    stoppable = True

    def __init__(self):
        self.lender = CountingLender()
        self.gate = threading.Event()
        self.started = threading.Event()

    def when_lost(self, answer) -> None:
        """Never lost: one process."""

    def generate_batch(self, requests, lease, on_step=None, on_latents=None):
        assert isinstance(lease, Lease) and lease.ids == tuple((ref.adapter_id, ref.scale) for ref in requests[0].loras)
        if requests[0].prompt == "wait":
            self.started.set()
            self.gate.wait(30)
        if requests[0].prompt == "boom":
            raise RuntimeError("the pipeline failed")
        return [GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.0) for _ in requests]


def _request(prompt: str, adapter_id: str = "a") -> GenerateRequest:
    return GenerateRequest(prompt=prompt, loras=[(adapter_id, 1.0)])


def test_a_lease_is_given_back_once():
    returned = []
    lease = Lease([(Item("a"), 1.0), (Item("b"), 0.5)], returned.append)
    assert lease.ids == (("a", 1.0), ("b", 0.5))
    with lease:
        assert returned == []
    lease.release()
    assert returned == [Item("a"), Item("b")]


def test_the_worker_gives_back_every_lease_however_the_request_ends():
    engine = FakeEngine()
    worker = GpuWorker(engine, SchedulerConfig(max_queue=2))
    worker.start()
    try:
        running = worker.submit(_request("wait", "first"))
        assert engine.started.wait(30)
        cancelled = worker.submit(_request("x", "cancelled"))
        failing = worker.submit(_request("boom", "failing"))
        with pytest.raises(Overloaded):
            worker.submit(_request("x", "refused"))
        assert cancelled.cancel()
        engine.gate.set()
        assert running.result(timeout=30).image.size == (8, 8)
        with pytest.raises(RuntimeError, match="the pipeline failed"):
            failing.result(timeout=30)
        with pytest.raises(CancelledError):
            cancelled.result(timeout=0)
        with pytest.raises(AdapterNotFound):
            worker.submit(_request("x", "missing")).result(timeout=30)
    finally:
        worker.stop(30)
    lent = [item.adapter_id for item in engine.lender.lent]
    assert sorted(lent) == ["cancelled", "failing", "first", "refused"]
    assert sorted(item.adapter_id for item in engine.lender.returned) == sorted(lent), "each lease given back once"


STEPS = 10_000


@pytest.mark.parametrize("cancelled_in_batch", [1, 2])
def test_a_running_request_stops_at_its_next_step_once_all_its_batch_is_cancelled(cancelled_in_batch):
    engine = SteppingEngine(CountingLender(), STEPS)
    worker = GpuWorker(engine, SchedulerConfig(max_queue=4, max_batch=2))
    first, second = worker.submit(_request("x")), worker.submit(_request("x"))  # queued first: one batch
    worker.start()
    try:
        assert engine.started.wait(30), "the batch of two started"
        cancels = [job.cancel() for job in (first, second)[:cancelled_in_batch]]
        assert cancels == [False] * cancelled_in_batch, "running: not cancelled, asked to stop"
        engine.gate.set()
        if cancelled_in_batch == 2:
            with pytest.raises(Stopped, match="cancelled at step 2 of 10000"):
                first.result(timeout=30)
            assert (worker.stopped, engine.steps_run) == (2, 2)
        else:
            assert second.result(timeout=30).image.size == (8, 8), "another request of the batch still wants it"
            assert (worker.stopped, engine.steps_run) == (0, STEPS)
        assert worker.submit(_request("x", "after")).result(timeout=30), "the worker serves on"
    finally:
        worker.stop(30)
    assert sorted(i.adapter_id for i in engine.lender.returned) == sorted(i.adapter_id for i in engine.lender.lent)


def test_the_engine_swaps_what_a_lease_holds(adapter_factory):
    adapter_factory("lease-a", "tiny-sd", rank=4, seed=11)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    with engine.lender.lease(as_refs([("lease-a", 0.5)])).result(timeout=60) as lease:
        assert engine.apply(lease) > 0 and engine.applied_ids == (("lease-a", 0.5),)
        assert [row["in_use"] for row in engine.adapters.cache.table()] == [1]
    assert [row["in_use"] for row in engine.adapters.cache.table()] == [0], "given back: the cache may evict it"
    assert engine.applied_ids == (("lease-a", 0.5),), "giving the lease back leaves the model as it is"
