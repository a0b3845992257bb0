"""What the local and Ray backends share: the wait on a result that watches the client, and
the one adapter table over several models or replicas."""

import asyncio
from concurrent.futures import Future

import pytest

from loraswap.server.backend import ClientGone, wait_for_result
from loraswap.server.routing import merge_adapter_rows


def test_a_result_is_awaited_and_a_client_that_leaves_cancels_it():
    async def scenario():
        done = Future()
        done.set_result("an image")
        assert await wait_for_result(asyncio.wrap_future(done), done.cancel, None) == "an image"
        checks = []

        async def gone_on_third_check():
            checks.append(1)
            return len(checks) >= 3

        pending = Future()
        with pytest.raises(ClientGone):
            await wait_for_result(asyncio.wrap_future(pending), pending.cancel, gone_on_third_check)
        assert len(checks) == 3 and pending.cancelled(), "cancelled once the client was gone, not before"

    asyncio.run(scenario())


def test_a_cancelled_wait_cancels_the_work():
    async def scenario():
        pending = Future()
        waiting = asyncio.ensure_future(wait_for_result(asyncio.wrap_future(pending), pending.cancel, None))
        await asyncio.sleep(0.15)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pending.cancelled()

    asyncio.run(scenario())


def row(adapter_id, cached="disk", kept=False, applied=False, **figures):
    return {"id": adapter_id, "cached": cached, "kept": kept, "applied": applied, **figures}


def test_one_row_per_adapter_from_the_fastest_tier():
    rows = merge_adapter_rows([
        ("sd", row("a")), ("sd", row("b", "host", kept=True, rank=4)), ("sd", row("owner/hub", "host", rank=8)),
        ("xl", row("a", "gpu", applied=True, rank=16)), ("xl", row("b")), ("xl", row("c")),
        ("xl", row("owner/hub", "gpu", kept=True, rank=8)),
    ])
    assert rows == [
        {**row("a", "gpu", applied=True, rank=16), "model": "xl"},
        {**row("b", "host", kept=True, rank=4), "model": "sd"},
        {**row("c"), "model": None},
        {**row("owner/hub", "gpu", kept=True, rank=8), "model": "xl"},
    ]
    assert merge_adapter_rows([("sd", row("a", "host")), ("xl", row("a", "host", applied=True))]) == [
        {**row("a", "host", applied=True), "model": "sd"}], "equal tiers: the first model's, flags of both"
