"""Video jobs and their MP4s: the job store's states, progress, TTL cleanup (an injected
clock), caps, failures and cancellation; the H.264 encoder; the routes in-process over a
FakeBackend (a client that leaves, the form's fields, refusals)."""

import asyncio
import logging
import time

import imageio.v3 as iio
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from support.fakes import fake_app, frame_red
from support.servers import form

from loraswap.adapters.reference import as_refs
from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import AdapterNotFound, Overloaded
from loraswap.media.mp4 import encode_mp4
from loraswap.server.config import ServerConfig
from loraswap.server.videos.store import VideoNotFound, VideoNotReady, VideoStatus, VideoStore


def read_mp4(data: bytes) -> tuple[np.ndarray, dict]:
    """(frames as (n, height, width, 3), metadata) of MP4 bytes, read back with imageio."""
    frames = iio.imread(data, extension=".mp4", plugin="FFMPEG", index=None)
    return frames, iio.immeta(data, extension=".mp4", plugin="FFMPEG")


def frames_of(n: int, size=(16, 16)) -> list[Image.Image]:
    return [Image.new("RGB", size, (frame_red(i), 120, 60)) for i in range(n)]


def video_result(n: int, fps: int | None = 8) -> GenerateResult:
    frames = frames_of(n)
    return GenerateResult(frames[0], 0, 0.0, 0.01, frames=frames, fps=fps)


class Clock:
    """An injected wall clock: tests move it by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def store_of(clock=None, **config) -> VideoStore:
    return VideoStore(ServerConfig(**config), clock or Clock())


REQUEST = GenerateRequest(prompt="a fox running", frames=3, seed=1)


async def settle(job, timeout: float = 10.0) -> None:
    """Until the job's task ends (it encodes in a thread)."""
    await asyncio.wait_for(asyncio.shield(job.task), timeout)


# ---------------------------------------------------------------- the encoder
def test_encode_mp4_gives_h264_yuv420p_at_the_fps_with_every_frame_in_order():
    data = encode_mp4(frames_of(9, (32, 24)), fps=8)
    frames, meta = read_mp4(data)
    assert frames.shape == (9, 24, 32, 3)
    assert meta["codec"] == "h264" and meta["pix_fmt"].startswith("yuv420p") and meta["fps"] == 8
    reds = [int(np.median(frame[..., 0])) for frame in frames]
    assert all(abs(red - frame_red(i)) <= 4 for i, red in enumerate(reds)), reds
    assert data.index(b"moov") < data.index(b"mdat"), "the index first (+faststart): playable while downloading"


def test_an_odd_size_is_padded_by_one_repeating_the_edge():
    frame = Image.new("RGB", (33, 17), (20, 20, 20))
    frame.paste((220, 220, 220), (32, 0, 33, 17))  # the last column light, the last row dark
    frames, _ = read_mp4(encode_mp4([frame, frame], fps=4))
    assert frames.shape == (2, 18, 34, 3), "padded to even, not scaled"
    assert frames[0, 8, 33, 0] > 180 and frames[0, 17, 5, 0] < 60, "the new column and row repeat the edge"


@pytest.mark.parametrize("frames,fps,phrase", [([], 8, "at least one"), (frames_of(2), 0, "at least 1"),
                                              (frames_of(1) + frames_of(1, (8, 8)), 8, "one size")])
def test_encode_mp4_refuses_what_cannot_be_a_video(frames, fps, phrase):
    with pytest.raises(ValueError, match=phrase):
        encode_mp4(frames, fps)


# ---------------------------------------------------------------- the job store
def test_a_job_goes_queued_in_progress_completed_with_its_progress():
    clock = Clock()

    async def scenario():
        store = store_of(clock, video_ttl_s=60)
        step, finish = asyncio.Event(), asyncio.Event()

        async def make(job):
            await step.wait()
            job.report_step(1, 4)
            await finish.wait()
            job.report_step(4, 4)
            return video_result(3)

        job = store.submit(REQUEST, "styles/anime", None, make)
        await asyncio.sleep(0)
        seen = [(job.status, job.progress)]
        step.set()
        await asyncio.sleep(0)
        seen.append((job.status, job.progress))
        with pytest.raises(VideoNotReady, match="in_progress.*poll GET /v1/videos/"):
            store.completed(job.id)
        clock.now += 5
        finish.set()
        await settle(job)
        seen.append((job.status, job.progress))
        return job, seen, store

    job, seen, store = asyncio.run(scenario())
    assert seen == [(VideoStatus.QUEUED, 0), (VideoStatus.IN_PROGRESS, 25), (VideoStatus.COMPLETED, 100)]
    view = job.view()
    assert view["id"].startswith("video_") and len(view["id"]) == 6 + 32
    assert {k: view[k] for k in ("object", "model", "status", "progress", "prompt", "seconds", "size", "error")} == {
        "object": "video", "model": "styles/anime", "status": "completed", "progress": 100,
        "prompt": "a fox running", "seconds": "0.375", "size": "16x16", "error": None}  # 3 frames at 8 fps
    assert (view["created_at"], view["completed_at"], view["expires_at"]) == (1000, 1005, 1065)
    assert store.completed(job.id) is job and read_mp4(job.mp4)[0].shape[0] == 3
    assert job.thumbnail.getpixel((0, 0)) == (frame_red(0), 120, 60)


def test_fps_comes_from_the_request_then_the_model_then_the_server():
    async def scenario():
        store = store_of(video_fps=5)
        jobs = [store.submit(REQUEST, "m", asked, _returning(video_result(4, fps=model_fps)))
                for asked, model_fps in ((2, 8), (None, 8), (None, None))]
        for job in jobs:
            await settle(job)
        return jobs

    assert [read_mp4(job.mp4)[1]["fps"] for job in asyncio.run(scenario())] == [2, 8, 5]


def _returning(result: GenerateResult):
    async def make(job):
        return result
    return make


def test_finished_jobs_expire_after_the_ttl_and_unfinished_ones_never():
    clock = Clock()

    async def scenario():
        store = store_of(clock, video_ttl_s=60)
        done = store.submit(REQUEST, "m", None, _returning(video_result(2)))
        await settle(done)
        never = asyncio.Event()

        async def hangs(job):
            await never.wait()

        running = store.submit(REQUEST, "m", None, hangs)
        clock.now += 59.9
        assert store.get(done.id) is done
        clock.now += 0.1  # finished at 1000, kept 60 s
        assert store.sweep() == [done.id]
        with pytest.raises(VideoNotFound, match="expired"):
            store.get(done.id)
        clock.now += 10**6
        assert store.get(running.id) is running and len(store) == 1
        await store.stop()
        return running

    assert asyncio.run(scenario()).task.cancelled(), "stop() cancels what is unfinished"


def test_a_failed_job_keeps_its_error_and_has_no_content(caplog):
    async def fails(job):
        raise AdapterNotFound("nope", "no such adapter", "Check the id")

    async def breaks(job):
        raise RuntimeError("boom inside")

    async def scenario():
        store = store_of()
        jobs = [store.submit(REQUEST, "m", None, make) for make in (fails, breaks, _returning(
            GenerateResult(Image.new("RGB", (8, 8)), 0, 0.0, 0.01)))]  # an image model: no frames
        for job in jobs:
            await settle(job)
        with pytest.raises(VideoNotReady, match="failed, so it has no content: adapter 'nope'"):
            store.completed(jobs[0].id)
        return jobs

    with caplog.at_level(logging.ERROR, logger="loraswap.server"):
        jobs = asyncio.run(scenario())
    assert all(job.status is VideoStatus.FAILED and job.view()["expires_at"] for job in jobs)
    assert [job.error["code"] for job in jobs] == ["adapter_not_found", "internal_error", "unsupported_input"]
    assert "makes images, not videos" in jobs[2].error["message"]
    assert jobs[0].error["message"] == "adapter 'nope': no such adapter. Check the id"
    assert jobs[1].error["message"] == "internal server error", "no internals reach the client"
    assert "boom inside" in caplog.text and "Traceback" in caplog.text, "logged with its traceback"


def _listed(store, video_id: str) -> bool:
    try:
        store.get(video_id)
    except VideoNotFound:
        return False
    return True


def test_caps_on_pending_and_kept_jobs():
    clock = Clock()

    async def scenario():
        store = store_of(clock, max_video_jobs=3, max_video_jobs_pending=2)
        first = store.submit(REQUEST, "m", None, _returning(video_result(1)))
        await settle(first)
        clock.now += 1
        second = store.submit(REQUEST, "m", None, _returning(video_result(1)))
        await settle(second)
        gate = asyncio.Event()

        async def waits(job):
            await gate.wait()
            return video_result(1)

        pending = [store.submit(REQUEST, "m", None, waits) for _ in range(2)]
        with pytest.raises(Overloaded, match="2 videos are being made"):
            store.submit(REQUEST, "m", None, waits)
        ids = {first.id: "first", second.id: "second", **{job.id: "pending" for job in pending}}
        kept = sorted(name for job_id, name in ids.items() if _listed(store, job_id))
        gate.set()
        for job in pending:
            await settle(job)
        return kept

    # 3 kept at most: the second pending job dropped the oldest finished one, never a pending one
    assert asyncio.run(scenario()) == ["pending", "pending", "second"]
    with pytest.raises(ValueError, match="max_video_jobs .* must be at least max_video_jobs_pending"):
        ServerConfig(max_video_jobs=2, max_video_jobs_pending=3)


def test_delete_cancels_an_unfinished_job():
    async def scenario():
        store = store_of()
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow(job):
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        job = store.submit(REQUEST, "m", None, slow)
        await started.wait()
        assert store.delete(job.id) is job
        await asyncio.wait_for(cancelled.wait(), 5)
        with pytest.raises(VideoNotFound):
            store.get(job.id)

    asyncio.run(scenario())


def test_a_deleted_job_counts_as_pending_until_its_generation_has_stopped():
    async def scenario():
        store = store_of(max_video_jobs_pending=1)
        started, stop = asyncio.Event(), asyncio.Event()

        async def stops_at_its_next_step(job):
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:  # as `wait_for_result` does: waits for the GPU worker to stop
                await stop.wait()
                raise

        job = store.submit(REQUEST, "m", None, stops_at_its_next_step)
        await started.wait()
        store.delete(job.id)
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="1 videos are being made"):
            store.submit(REQUEST, "m", None, _returning(video_result(1)))
        stop.set()
        await asyncio.gather(job.task, return_exceptions=True)
        await settle(store.submit(REQUEST, "m", None, _returning(video_result(1))))
        await store.stop()

    asyncio.run(scenario())


def test_a_job_is_its_owners_only():
    async def scenario():
        store = store_of()
        job = store.submit(REQUEST, "m", None, _returning(video_result(1)), owner="owner-a")
        await settle(job)
        for ask in (store.get, store.completed, store.delete):
            with pytest.raises(VideoNotFound):
                ask(job.id, "owner-b")
        assert store.completed(job.id, "owner-a") is job
        everyones = store.submit(REQUEST, "m", None, _returning(video_result(1)))  # a server without keys
        await settle(everyones)
        assert store.get(everyones.id, "owner-b") is everyones
        await store.stop()

    asyncio.run(scenario())


# ---------------------------------------------------------------- the routes, in-process
def poll(client, video_id: str, status: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (view := client.get(f"/v1/videos/{video_id}").json())["status"] != status:
        assert time.monotonic() < deadline, view
        time.sleep(0.02)
    return view


def test_a_job_survives_the_client_that_made_it_and_reports_progress():
    app, backend = fake_app()
    backend.hold_before_step = 1
    with TestClient(app) as client:
        created = client.post("/v1/videos", files=form(prompt="a fox", model="styles/anime:0.8", frames=5,
                                                        num_inference_steps=2, seed=7, guidance_scale=4.5,
                                                        negative_prompt="blur", size="32x16"))
        assert created.status_code == 200, created.text
        job = created.json()
        assert (job["status"], job["progress"], job["model"], job["size"]) == ("queued", 0, "styles/anime:0.8",
                                                                               "32x16")
        in_progress = poll(client, job["id"], "in_progress")  # 1 of 2 steps reported, then held
        assert in_progress["progress"] == 50
        early = client.get(f"/v1/videos/{job['id']}/content")
        assert early.status_code == 409 and "in_progress" in early.json()["error"]["message"]
        backend.resume.set()
        done = poll(client, job["id"], "completed")
        assert client.get(f"/v1/videos/{job['id']}").headers["openai-poll-after-ms"] == "1000"
        content = client.get(f"/v1/videos/{job['id']}/content")
        thumbnail = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert backend.client_gone_seen == [False, False], "nothing cancels a job whose client has left"
    request, model = backend.generated[0]
    assert (request.frames, request.steps, request.seed, request.guidance, request.negative_prompt) == (
        5, 2, 7, 4.5, "blur")
    # with one video model hosted, adapters named alone go to it
    assert (request.loras, model, request.width, request.height) == (as_refs([("styles/anime", 0.8)]), "fake", 32, 16)
    assert done["seconds"] == "0.625" and done["size"] == "32x16"  # 5 frames at the model's 8 fps
    assert content.headers["content-type"] == "video/mp4" and read_mp4(content.content)[0].shape == (5, 16, 32, 3)
    assert thumbnail.headers["content-type"] == "image/webp"


def test_seconds_times_fps_gives_the_frames():
    app, backend = fake_app(video_fps=6)
    with TestClient(app) as client:
        default_fps = client.post("/v1/videos", files=form(prompt="x", seconds="2")).json()
        asked_fps = client.post("/v1/videos", files=form(prompt="x", seconds="1.5", fps=4)).json()
        poll(client, asked_fps["id"], "completed")
        _, meta = read_mp4(client.get(f"/v1/videos/{asked_fps['id']}/content").content)
    assert [r.frames for r, _ in backend.generated] == [12, 6]
    assert (default_fps["seconds"], asked_fps["seconds"], meta["fps"]) == ("2", "1.5", 4)


@pytest.mark.parametrize("fields,status,phrase", [
    (dict(prompt="x", frames=500), 400, "frames 500 must be between 1 and 121"),
    (dict(prompt="x", num_frames=0), 400, "num_frames 0 must be between 1 and 121"),
    (dict(prompt="x", seconds=10, fps=30), 400, "seconds 10 at 30 fps is 300 frames; a video has 1 to 121"),
    (dict(prompt="x", seconds=0.01), 400, "is 0 frames"),
    (dict(prompt="x", seconds=-1), 400, "seconds -1.0 must be more than 0"),
    (dict(prompt="x", seconds="inf"), 400, "finite"),
    (dict(prompt="x", seconds=4, frames=9), 400, "both seconds and frames"),
    (dict(prompt="x", fps=500), 400, "fps 500 must be between 1 and 60"),
    (dict(prompt="x", size="33x16"), 400, "multiple of 8"),
    (dict(prompt="x", steps=4), 400, "steps"),  # a misspelt extension is refused, not ignored
    (dict(prompt="x", input_reference="an image"), 422, "input_reference"),
    (dict(prompt="x", model="../etc"), 400, "invalid adapter id"),
])
def test_bad_video_requests_are_refused_with_what_to_fix(fields, status, phrase):
    app, backend = fake_app()
    with TestClient(app) as client:
        response = client.post("/v1/videos", files=form(**fields))
    assert response.status_code == status, response.text
    assert phrase in response.json()["error"]["message"]
    assert backend.generated == []


def test_unknown_ids_json_bodies_variants_and_the_pending_cap():
    app, backend = fake_app(max_video_jobs_pending=1)
    backend.hold_before_step = 0
    with TestClient(app) as client:
        assert client.get("/v1/videos/video_nope").status_code == 404
        missing = client.get("/v1/videos/video_nope/content")
        assert missing.status_code == 404 and "no video 'video_nope'" in missing.json()["error"]["message"]
        as_json = client.post("/v1/videos", json={"prompt": "x"})
        assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
        job = client.post("/v1/videos", files=form(prompt="x", frames=2)).json()
        full = client.post("/v1/videos", files=form(prompt="x", frames=2))
        assert full.status_code == 503 and "retry-after" in full.headers
        spritesheet = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "spritesheet"})
        assert spritesheet.status_code == 400 and "variant" in spritesheet.json()["error"]["message"]
        assert spritesheet.json()["error"]["param"] == "variant"
        deleted = client.delete(f"/v1/videos/{job['id']}")
        assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert client.get(f"/v1/videos/{job['id']}").status_code == 404
