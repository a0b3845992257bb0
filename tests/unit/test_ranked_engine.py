"""Context parallelism attaches beside the engine: a `RankedEngine` sends each batch, its seeds
chosen, from rank 0 to the others, has every rank agree that it applied the adapters (a rank
that applied them while another could not goes back to the base model and raises that rank's
error), and tells the other ranks' stores what rank 0's does. Here one gloo process stands for
the ranks and a stand-in for `Ranks` records what they would be told; the split itself, and
two real ranks, are `tests/integration/test_context_parallel.py`'s."""

import pytest
import torch.distributed as dist
from support.numerics import assert_bitwise_equal, weights_snapshot
from support.servers import free_port

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.parallel.ranked import RankedEngine, ReadAlong
from loraswap.engine.request import GenerateRequest
from loraswap.errors import AdapterInvalid, UnsupportedInput


class Ranks:
    """Stands in for `parallel.ranks.Ranks`: records what the engine says to the other ranks;
    when they agree, another rank reports `other_error` (None: it applied the adapters too)."""

    def __init__(self, leading: bool = True, other_error: BaseException | None = None):
        self.leading, self.rank, self.other_error = leading, 0 if leading else 1, other_error
        self.led, self.told, self.agreed, self.ended_together = [], [], [], 0

    def lead(self, requests: list[GenerateRequest]) -> None:
        self.led.append(requests)

    def tell(self, verb: str, refs: list[AdapterRef]) -> None:
        self.told.append((verb, [ref.adapter_id for ref in refs]))

    def agree(self, error: BaseException | None, versions: tuple = ()) -> BaseException | None:
        self.agreed.append((error, versions))
        return error if error is not None else self.other_error

    def together(self, make):
        self.ended_together += 1
        return make()


@pytest.fixture(scope="module")
def engine(adapter_factory, tmp_path_factory):
    """Rank 0 of a process group of one, its model split over it (that is, not split)."""
    folder = tmp_path_factory.mktemp("ranked")
    adapter_factory("a", "tiny-sd", seed=90, folder=folder)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ranked = RankedEngine(EngineConfig(model="tiny-sd", adapters=folder, compile=False, warmup=False))
        ranked.own_lender = ranked.lender
        yield ranked
    finally:
        dist.destroy_process_group()


def _ranked(engine: RankedEngine, ranks: Ranks) -> RankedEngine:
    engine.lender = engine.own_lender  # each test's ranks from the start
    engine.restore_base()
    engine.use_ranks(ranks)
    return engine


def _request(**fields) -> GenerateRequest:
    return GenerateRequest(**{"prompt": "a red fox", "steps": 2, "width": 64, "height": 64, **fields})


def test_rank_0_sends_the_batch_with_its_seeds_and_every_rank_agrees_before_generating(engine):
    ranks = Ranks()
    _ranked(engine, ranks)
    request = _request(loras=[("a", 1.0)])  # no seed: rank 0 chooses it, and the others get it
    with engine.lender.lease_now(request.loras) as lease:
        result = engine.generate_batch([request], lease)[0]
    [[sent]] = ranks.led
    assert sent.seed == result.seed and sent.prompt == request.prompt and sent.loras == request.loras
    [(error, versions)] = ranks.agreed
    assert error is None and [adapter_id for adapter_id, _ in versions] == ["a"]
    assert ranks.ended_together == 1 and engine.applied_ids == (("a", 1.0),)


def test_a_rank_that_applied_the_adapters_goes_back_to_the_base_when_another_could_not(engine):
    _ranked(engine, Ranks())
    base = weights_snapshot(engine.components)
    elsewhere = AdapterInvalid("a", "truncated on rank 1", "Download it again")
    engine.use_ranks(Ranks(other_error=elsewhere))
    with engine.lender.lease_now([AdapterRef("a")]) as lease, pytest.raises(AdapterInvalid) as raised:
        engine.generate_batch([_request(loras=[("a", 1.0)], seed=3)], lease)
    assert raised.value is elsewhere, "the failing rank's error, on every rank"
    assert engine.applied_ids == ()
    assert_bitwise_equal(base, engine.components)


def test_a_follower_that_refuses_the_call_tells_rank_0_which_waits_for_its_word(engine):
    ranks = Ranks(leading=False)
    _ranked(engine, ranks)
    with engine.lender.lease_now([]) as lease, pytest.raises(UnsupportedInput):
        engine.generate_batch([_request(step_cache="first-block:threshold=0.1")], lease)  # a UNet takes none
    [(error, _)] = ranks.agreed
    assert isinstance(error, UnsupportedInput) and ranks.led == [] and engine.applied_ids == ()


def test_rank_0s_leases_tell_the_others_to_read_and_its_store_keeps_and_evicts_on_every_rank(engine):
    ranks = Ranks()
    _ranked(engine, ranks)
    assert isinstance(engine.lender, ReadAlong)
    engine.lender.lease([AdapterRef("a")]).result(timeout=60).release()  # a queued request's
    engine.lender.lease([]).result(timeout=60).release()
    engine.lender.lease_now([AdapterRef("a")]).release()  # a caller on this thread: no one to tell
    engine.keep_adapter(AdapterRef("a"))
    engine.evict_adapter(AdapterRef("a"), download_too=False)
    assert ranks.told == [("read", ["a"]), ("keep", ["a"]), ("evict", ["a"])]
    follower = Ranks(leading=False)
    _ranked(engine, follower)
    assert engine.lender is engine.own_lender, "a follower leases what rank 0 sends: it tells no one"


def test_only_a_one_process_engine_stops_or_retries_an_image_alone():
    """What the GPU worker and the start-up ask of any engine: a ranked engine's processes make
    each image in step, so none stops one at a step or makes its first one again on its own."""
    assert Engine.stoppable and Engine.retries_first_image
    assert not RankedEngine.stoppable and not RankedEngine.retries_first_image
