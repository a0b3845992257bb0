"""The GPU worker answers a request once its lease is given back, answers a request whose
adapter failed at once (not after its batch's image), and answers each job of a batch alone."""

import threading
from concurrent.futures import Future

from loraswap.adapters.lease import Lease
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker
from loraswap.errors import AdapterNotFound, Overloaded


class Lender:
    """Lends at once, but fails the lease numbered `failing` (1-based); counts the leases given back."""

    def __init__(self, failing: int | None = None):
        self.lent = self.returned = 0
        self.failing = failing

    def lease(self, refs, located=None) -> Future:
        self.lent += 1
        future: Future = Future()
        if self.lent == self.failing:
            future.set_exception(AdapterNotFound("style", "gone meanwhile", "style"))
        else:
            future.set_result(Lease([(object(), 1.0)], self._given_back))
        return future

    def _given_back(self, held) -> None:
        self.returned += 1


class Engine:
    """Makes blank results; `during()` runs while a batch generates."""

    stoppable = True
    applied_ids = ()

    def __init__(self, lender: Lender, during=None):
        self.lender, self.during = lender, during

    def when_lost(self, answer) -> None:
        pass

    def generate_batch(self, requests, lease, on_step=None, on_latents=None):
        if self.during:
            self.during()
        return [GenerateResult(None, 0, 0.0, 0.0) for _ in requests]


def _request() -> GenerateRequest:
    return GenerateRequest(prompt="x", seed=1, loras=[("style", 1.0)])


def _worker(engine: Engine, batch: int) -> GpuWorker:
    return GpuWorker(engine, SchedulerConfig(max_batch=batch))


def test_an_answered_request_holds_no_adapter():
    engine = Engine(Lender())
    worker = _worker(engine, 1)
    future = worker.submit(_request())
    given_back_when_answered = []
    future.add_done_callback(lambda f: given_back_when_answered.append(engine.lender.returned))
    worker.start()
    try:
        future.result(10)
    finally:
        worker.stop(10)
    assert given_back_when_answered == [1]


def test_a_request_whose_adapter_failed_is_answered_before_its_batch_generates():
    gate = threading.Event()
    engine = Engine(Lender(failing=2), during=lambda: gate.wait(10))  # a long image: a video's tens of seconds
    worker = _worker(engine, 2)
    ok, failed = worker.submit(_request()), worker.submit(_request())
    worker.start()
    try:
        assert isinstance(failed.exception(timeout=3), AdapterNotFound), "answered at once"
        assert not ok.done()
    finally:
        gate.set()
        worker.stop(10)
    assert isinstance(ok.result(1), GenerateResult)


def test_a_job_answered_meanwhile_fails_no_other_of_its_batch():
    engine = Engine(Lender())
    worker = _worker(engine, 2)
    futures = [worker.submit(_request()) for _ in range(2)]
    # the first job answered while the batch generates, as `_fail_all` may from another thread
    engine.during = lambda: futures[0].set_exception(Overloaded("lost"))
    worker.start()
    try:
        assert isinstance(futures[1].result(10), GenerateResult)
    finally:
        worker.stop(10)
    assert isinstance(futures[0].exception(), Overloaded) and not worker.alive
