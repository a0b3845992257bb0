"""The GPU worker lets go of work at once: a request whose client left leaves the queue when it
is cancelled, and a shutdown answers the queued requests now (`drain`) and stops the running
batch at its next step (`halt`), each with a 503."""

from concurrent.futures import Future

import pytest
from support.fakes import SteppingEngine

from loraswap.adapters.lease import Lease
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker, ShuttingDown


class Lender:
    """Lends at once; records each adapter id given back."""

    def __init__(self):
        self.returned: list[str] = []

    def lease(self, refs, located=None) -> Future:
        future: Future = Future()
        future.set_result(Lease([(ref.adapter_id, ref.scale) for ref in refs], self.returned.append))
        return future


STEPS = 1000


def _request(adapter_id: str) -> GenerateRequest:
    return GenerateRequest(prompt="x", loras=[(adapter_id, 1.0)])


@pytest.fixture
def running():
    """(worker, engine, future): a worker whose first request is generating, held at step 2."""
    engine = SteppingEngine(Lender(), STEPS)
    worker = GpuWorker(engine, SchedulerConfig(max_queue=4))
    worker.start()
    first = worker.submit(_request("running"))
    assert engine.started.wait(30)
    yield worker, engine, first
    engine.gate.set()
    worker.stop(30)
    assert not worker.alive


def test_a_request_cancelled_while_queued_leaves_the_queue_at_once(running):
    worker, engine, first = running
    queued = worker.submit(_request("queued"))
    assert worker.queue_depth == 1
    assert queued.cancel()
    # the worker is still on the first request: the queue and the lease let go regardless
    assert (worker.queue_depth, worker.skipped_cancelled, engine.lender.returned) == (0, 1, ["queued"])
    assert not first.done()
    engine.gate.set()
    assert first.result(timeout=30).image.size == (8, 8)
    assert engine.lender.returned == ["queued", "running"], "each lease given back once"


def test_drain_answers_the_queued_now_and_halt_stops_the_running_at_its_next_step(running):
    worker, engine, first = running
    queued = [worker.submit(_request(f"queued-{i}")) for i in range(2)]
    assert worker.drain() == 2
    for future in queued:  # answered before the running request moves on
        error = future.exception(timeout=0)
        assert isinstance(error, ShuttingDown) and error.status == 503 and "still queued" in str(error)
    with pytest.raises(ShuttingDown, match="shutting down"):
        worker.submit(_request("late"))
    assert worker.queue_depth == 0 and not first.done(), "the running request goes on through the drain"
    assert worker.halt() == 1
    engine.gate.set()
    with pytest.raises(ShuttingDown, match="this image was stopped at step 2 of 1000; retry"):
        first.result(timeout=30)
    assert engine.steps_run == 2, "stopped at the step it was on"
    worker.stop(30)
    assert sorted(engine.lender.returned) == ["late", "queued-0", "queued-1", "running"]


def test_an_engine_that_cannot_stop_mid_image_finishes_its_batch():
    """A ranked engine's processes make each image in step (`Engine.stoppable` False): neither a
    halt nor its client leaving stops it at a step, where the other processes would wait for it."""
    engine = SteppingEngine(Lender(), 5)
    engine.stoppable = False
    worker = GpuWorker(engine, SchedulerConfig(max_queue=4))
    worker.start()
    running = worker.submit(_request("running"))
    assert engine.started.wait(30)
    running.cancel()
    assert worker.halt() == 0, "nothing to stop"
    engine.gate.set()
    worker.stop(30)
    assert engine.steps_run == 5 and worker.stopped == 0 and engine.lender.returned == ["running"]
