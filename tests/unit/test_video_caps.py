"""Video job caps in total and per API key: another key's jobs never evict a completed,
unexpired video; a key past its own caps drops its own oldest finished job, or is refused
(503 with Retry-After) when it has none to drop. In the store over an injected clock, and
through the routes with two API keys."""

import asyncio
import hashlib
import time

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from support.fakes import fake_app, frame_red
from support.servers import form

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.server.config import ServerConfig
from loraswap.server.videos import store as videos
from loraswap.server.videos.caps import VideoJobsFull
from loraswap.server.videos.store import VideoNotFound, VideoStatus, VideoStore

REQUEST = GenerateRequest(prompt="a fox", frames=1, seed=1)
K1, K2, K3 = "owner-k1", "owner-k2", "owner-k3"


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def one_frame(job):
    frame = Image.new("RGB", (16, 16), (frame_red(0), 120, 60))
    return GenerateResult(frame, 0, 0.0, 0.01, frames=[frame], fps=8)


@pytest.fixture
def quick_mp4(monkeypatch):
    """MP4 encoding replaced by distinct bytes a job (66 real encodes take seconds)."""
    made = iter(range(10**6))
    monkeypatch.setattr(videos, "encode_mp4", lambda frames, fps: b"mp4 %d" % next(made))


async def hangs(job):
    await asyncio.Event().wait()


async def made(store: VideoStore, owner: str):
    job = store.submit(REQUEST, "m", None, one_frame, owner=owner)
    await asyncio.wait_for(asyncio.shield(job.task), 10)
    return job


def _kept(store: VideoStore, job, owner) -> bool:
    try:
        return store.get(job.id, owner) is job
    except VideoNotFound:
        return False


def test_another_keys_66_jobs_never_evict_a_completed_video(tmp_path, quick_mp4):
    """The issue's case: K1 owns a completed video (TTL 3600 s); K2 makes 66 one-frame jobs. K2
    drops its own oldest finished jobs past its 16; K1's video stays, with the same bytes."""
    clock = Clock()

    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path, video_ttl_s=3600), clock)
        mine = await made(store, K1)
        before = hashlib.sha256(mine.mp4).digest()
        theirs = []
        for _ in range(66):
            clock.now += 1
            theirs.append(await made(store, K2))
        kept = store.completed(mine.id, K1)
        result = (hashlib.sha256(kept.mp4).digest() == before, [_kept(store, job, K2) for job in theirs], len(store))
        await store.stop()
        return result

    same_bytes, theirs_kept, total = asyncio.run(scenario())
    assert same_bytes, "K1's video is still served, the same bytes"
    assert theirs_kept == [False] * 50 + [True] * 16, "K2 keeps its newest 16: it dropped only its own"
    assert total == 17


def test_a_full_server_refuses_a_new_key_rather_than_evict_another_keys_video(tmp_path):
    """With the per-key caps as large as the total, K1 and K2 fill the server with completed
    videos: K3's job is refused (503) with a Retry-After of when the first expires, nothing
    dropped; K2 may still drop its own; once K1's first expires, K3 gets in."""
    clock = Clock()
    config = ServerConfig(state_dir=tmp_path, video_ttl_s=600, max_video_jobs=4, max_video_jobs_per_key=4,
                          max_video_jobs_pending=2, max_video_jobs_pending_per_key=2)

    async def scenario():
        store = VideoStore(config, clock)
        jobs = [await made(store, owner) for owner in (K1, K1, K2, K2)]
        clock.now += 100
        with pytest.raises(VideoJobsFull) as refused:
            store.submit(REQUEST, "m", None, one_frame, owner=K3)
        still = [_kept(store, job, job.owner) for job in jobs]
        own = await made(store, K2)  # K2 drops its own oldest
        after_own = [_kept(store, job, job.owner) for job in jobs]
        clock.now += 500  # K1's first (finished at 1000) expires at 1600
        newcomer = await made(store, K3)
        await store.stop()
        return refused.value, still, own, after_own, newcomer

    refused, still, own, after_own, newcomer = asyncio.run(scenario())
    assert refused.status == 503 and refused.retry_after_s == 500
    assert refused.message == ("this server keeps 4 videos, the most it keeps (--max-video-jobs), and those finished "
                               "are other API keys' until they expire or are deleted; retry when the first of them "
                               "expires in 500 s")
    assert still == [True] * 4, "the refusal dropped nothing"
    assert own.status is VideoStatus.COMPLETED and after_own == [True, True, False, True]
    assert newcomer.status is VideoStatus.COMPLETED


def test_a_key_past_its_pending_cap_is_refused_and_others_still_get_in(tmp_path):
    async def scenario():
        store = VideoStore(ServerConfig(state_dir=tmp_path, max_video_jobs_pending=8,
                                        max_video_jobs_pending_per_key=4), Clock())
        held = [store.submit(REQUEST, "m", None, hangs, owner=K2) for _ in range(4)]
        with pytest.raises(VideoJobsFull) as refused:
            store.submit(REQUEST, "m", None, hangs, owner=K2)
        other = await made(store, K1)
        store.delete(held[0].id, K2)
        await asyncio.sleep(0.05)  # its generation has stopped
        again = store.submit(REQUEST, "m", None, hangs, owner=K2)
        await store.stop()
        return refused.value, other, again

    refused, other, again = asyncio.run(scenario())
    assert refused.status == 503 and refused.retry_after_s is None
    assert refused.message == ("this API key has 4 videos being made, the most one key may have at once "
                               "(--max-video-jobs-pending-per-key); retry when one has finished")
    assert other.status is VideoStatus.COMPLETED and again.status is VideoStatus.QUEUED


def test_the_per_key_caps_are_settings_checked_against_each_other():
    with pytest.raises(ValueError, match=r"max_video_jobs_per_key \(2\) must be at least "
                                         r"max_video_jobs_pending_per_key \(3\)"):
        ServerConfig(max_video_jobs_per_key=2, max_video_jobs_pending_per_key=3)
    config = ServerConfig()
    assert (config.max_video_jobs_per_key, config.max_video_jobs_pending_per_key) == (16, 4)


# ---------------------------------------------------------------- through the routes, two API keys
def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def _made(client, key: str) -> dict:
    video = client.post("/v1/videos", files=form(prompt="a fox", frames=1), headers=_bearer(key))
    assert video.status_code == 200, video.text
    deadline = time.monotonic() + 10
    while (view := client.get(f"/v1/videos/{video.json()['id']}", headers=_bearer(key)).json())["status"] not in (
            "completed", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.01)
    return view


def test_through_the_routes_k2s_jobs_leave_k1s_video_and_a_full_server_answers_503_with_retry_after(
        tmp_path, quick_mp4):
    app, backend = fake_app(state_dir=tmp_path, api_keys=["key-1", "key-2", "key-3"], max_video_jobs=20,
                            max_video_jobs_per_key=19)
    with TestClient(app) as client:
        mine = _made(client, "key-1")
        mp4 = client.get(f"/v1/videos/{mine['id']}/content", headers=_bearer("key-1")).content
        theirs = [_made(client, "key-2") for _ in range(66)]
        polled = client.get(f"/v1/videos/{mine['id']}", headers=_bearer("key-1"))
        content = client.get(f"/v1/videos/{mine['id']}/content", headers=_bearer("key-1"))
        refused = client.post("/v1/videos", files=form(prompt="a fox", frames=1), headers=_bearer("key-3"))
        served = client.post("/", json={"inputs": "a fox"}, headers=_bearer("key-3"))
    assert all(view["status"] == "completed" for view in theirs)
    assert (polled.status_code, polled.json()["status"], content.status_code) == (200, "completed", 200)
    assert content.content == mp4, "the same bytes"
    assert refused.status_code == 503 and "other API keys' until they expire" in refused.json()["error"]["message"]
    assert 3590 <= int(refused.headers["retry-after"]) <= 3600, "when K1's video expires, not --retry-after-s"
    assert served.status_code == 200, "the server still serves"
