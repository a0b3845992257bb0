"""Ranks that cannot go on (one died, or fell out of step): rank 0's GPU worker answers every
request it holds, and each new one, with a 503 before the process exits for a restart; a
follower exits at once; a video job is left unfinished for the restart to make again."""

import asyncio
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from PIL import Image

from loraswap.adapters.lease import Lease
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.engine import GenerateResult
from loraswap.engine.parallel import loss as rank_loss
from loraswap.engine.parallel.loss import ANSWER_S, RankLoss, RanksLost
from loraswap.engine.request import GenerateRequest
from loraswap.engine.worker import GpuWorker
from loraswap.server.backend import LocalBackend
from loraswap.server.routing import Route


class Exited(BaseException):
    """The process ended at once (a follower's exit), in place of ending the test's."""


@pytest.fixture
def exits(monkeypatch) -> list[float]:
    """The exits asked for (seconds from then), instead of the process ending: one at once
    ends the caller's flow, as `os._exit` would."""
    asked: list[float] = []

    def exit_for_restart(after_s: float = 0.0) -> None:
        asked.append(after_s)
        if after_s == 0.0:
            raise Exited()

    monkeypatch.setattr(rank_loss, "exit_for_restart", exit_for_restart)
    return asked


class Lender:
    """Lends one item a request and counts those given back."""

    def __init__(self):
        self.lent = self.returned = 0

    def lease(self, refs, located=None) -> Future:
        self.lent += 1
        future = Future()
        future.set_result(Lease([(object(), 1.0)], self._give_back))
        return future

    def _give_back(self, item) -> None:
        self.returned += 1


class StuckEngine:
    """Rank 0's engine: its image stuck in a collective (a dead rank never answers) until `gate`;
    lost when its ranks' `loss` gives up (as `RankedEngine.when_lost` says)."""

    applied_ids = ()
    stoppable = False

    def __init__(self):
        self.loss = RankLoss(0)
        self.when_lost = self.loss.when_lost
        self.lender = Lender()
        self.gate, self.started = threading.Event(), threading.Event()

    def generate_batch(self, requests, lease, on_step=None, on_latents=None):
        self.started.set()
        self.gate.wait(30)
        return [GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.0) for _ in requests]


def test_rank_0_answers_every_request_it_holds_and_each_new_one_with_a_503(exits):
    engine = StuckEngine()
    worker = GpuWorker(engine, SchedulerConfig(max_queue=4))
    worker.start()
    generating = worker.submit(GenerateRequest(prompt="first"))
    assert engine.started.wait(30)
    queued = [worker.submit(GenerateRequest(prompt=f"queued {i}")) for i in range(2)]
    error = engine.loss.give_up("loraswap-rank-1 exited with code -9")
    assert error.status == 503 and "(loraswap-rank-1 exited with code -9)" in error.message
    assert exits == [ANSWER_S], "the exit is scheduled once, after the answers"
    for future in [generating, *queued]:  # at once, though the worker's thread is still stuck
        with pytest.raises(RanksLost, match="the server restarts: retry shortly"):
            future.result(timeout=0)
    with pytest.raises(RanksLost):
        worker.submit(GenerateRequest(prompt="after"))
    assert engine.loss.give_up("a message between the processes failed") is error
    assert exits == [ANSWER_S], "said once, whichever thread finds out next"
    engine.gate.set()  # the stuck image ends after all: its answer is already out, the worker lives on
    worker.stop(timeout=30)
    assert not worker.alive and worker.queue_depth == 0
    assert engine.lender.returned == engine.lender.lent == 4, "every lease given back"


def test_a_follower_exits_at_once(exits):
    answered = []
    loss = RankLoss(1)
    loss.when_lost(answered.append)
    with pytest.raises(Exited):
        loss.give_up("the processes did not all end an image")
    assert exits == [0.0] and answered == [], "no client waits on a follower"


class Backend(LocalBackend):
    """Rank 0's server whose ranks are lost: every request's future fails with the 503."""

    def __init__(self):
        super().__init__(SimpleNamespace(), config=None)
        failed = Future()
        failed.set_exception(RanksLost("one of the processes failed"))
        hosted = SimpleNamespace(worker=SimpleNamespace(submit=lambda request, on_step, located: failed),
                                 engine=SimpleNamespace(adapters=SimpleNamespace(source=None),
                                                        calls=SimpleNamespace(sized=lambda request: request),
                                                        step_cache=SimpleNamespace(resolved=lambda request: request)))
        self.state.deployment = SimpleNamespace(route=lambda refs, model: Route(hosted, {}), hosted=[hosted])


def test_a_client_gets_the_503_and_a_video_job_is_left_for_the_restart():
    async def scenario():
        backend = Backend()

        async def connected() -> bool:
            return False

        with pytest.raises(RanksLost):
            await backend.generate(GenerateRequest(prompt="x"), None, connected)
        video = asyncio.ensure_future(backend.generate(GenerateRequest(prompt="x"), None, None))
        done, _ = await asyncio.wait([video], timeout=0.5)
        assert not done, "a video job is neither finished nor failed: its row stays for the next start"
        video.cancel()

    asyncio.run(scenario())
