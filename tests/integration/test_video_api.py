"""The OpenAI videos API with the real `openai` client, against a real server on loopback:
over a FakeBackend that makes N frames (create_and_poll, download_content, the MP4 read
back with imageio; the client's errors for unknown ids and early downloads), and end to end
over the real engine of tiny-wan."""

import time

import httpx
import imageio.v3 as iio
import numpy as np
import openai
import pytest
from openai import OpenAI
from support.fakes import fake_app, frame_red, serve_on_loopback

from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

ADAPTER = "styles/anime"


@pytest.fixture(scope="module")
def video_server():
    app, backend = fake_app(video_fps=6)
    with serve_on_loopback(app) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), backend


def read_mp4(data: bytes) -> tuple[np.ndarray, dict]:
    return (iio.imread(data, extension=".mp4", plugin="FFMPEG", index=None),
            iio.immeta(data, extension=".mp4", plugin="FFMPEG"))


def test_create_and_poll_then_download_an_mp4_with_the_frames_asked_for(video_server):
    client, backend = video_server
    video = client.videos.create_and_poll(model=ADAPTER, prompt="a fox running through snow", size="48x32",
                                          extra_body={"frames": 9, "seed": 3, "num_inference_steps": 3,
                                                      "guidance_scale": 5.0, "negative_prompt": "blurry"},
                                          poll_interval_ms=50)
    assert (video.status, video.progress, video.object, video.model) == ("completed", 100, "video", ADAPTER)
    assert video.error is None and video.completed_at >= video.created_at
    assert video.expires_at == video.completed_at + 3600
    assert (video.size, video.seconds) == ("48x32", "1.125")  # 9 frames at the model's 8 fps
    data = client.videos.download_content(video.id).content
    frames, meta = read_mp4(data)
    assert frames.shape == (9, 32, 48, 3) and meta["codec"] == "h264" and meta["fps"] == 8
    reds = [int(np.median(frame[..., 0])) for frame in frames]
    assert all(abs(red - frame_red(i)) <= 4 for i, red in enumerate(reds)), reds
    request = next(r for r, _ in backend.generated if r.prompt == "a fox running through snow")
    assert (request.frames, request.seed, request.steps, request.guidance, request.negative_prompt) == (
        9, 3, 3, 5.0, "blurry")
    assert request.loras == as_refs([(ADAPTER, 1.0)])


def test_seconds_from_the_client_count_in_the_servers_fps(video_server):
    client, backend = video_server
    video = client.videos.create_and_poll(prompt="a slow river", seconds="4", extra_body={"fps": 2},
                                          poll_interval_ms=50)
    frames, meta = read_mp4(client.videos.download_content(video.id).content)
    assert (frames.shape[0], meta["fps"], video.seconds, video.model) == (8, 2, "4", "fake")
    video = client.videos.create_and_poll(prompt="a fast river", seconds="4", poll_interval_ms=50)
    frames, meta = read_mp4(client.videos.download_content(video.id).content)
    assert (frames.shape[0], meta["fps"]) == (24, 6)  # 4 s at video_fps 6, played at 6: it lasts 4 s


def test_the_clients_errors_unknown_ids_early_downloads_and_delete(video_server):
    client, backend = video_server
    with pytest.raises(openai.NotFoundError) as missing:
        client.videos.retrieve("video_nope")
    assert "no video 'video_nope'" in missing.value.response.json()["error"]["message"]
    assert "no video 'video_nope'" in missing.value.message and "no video 'video_nope'" in str(missing.value)
    backend.hold_before_step = 0  # the next video waits before its first step: queued
    try:
        video = client.videos.create(prompt="a held fox", extra_body={"frames": 2})
        assert video.status == "queued"
        with pytest.raises(openai.ConflictError):
            client.videos.download_content(video.id)
        assert client.videos.delete(video.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
    finally:
        backend.hold_before_step = None
    with pytest.raises(openai.BadRequestError) as bad:
        client.videos.create(prompt="x", extra_body={"frames": 1000})
    assert "frames 1000 must be between 1 and 121" in bad.value.response.json()["error"]["message"]


# ---------------------------------------------------------------- end to end: the real tiny-wan
@pytest.fixture(scope="module")
def wan_server(adapter_factory):
    """A real server on loopback over the real engine of tiny-wan (Wan 2.2 style, 2 experts)."""
    root = adapter_factory.root / "wan"
    adapter_factory("wan/motion", "tiny-wan", rank=4, targets="attn", seed=31, folder=root)
    app = create_app(ServerConfig(engines=[EngineConfig(model="tiny-wan", adapters=root, compile=False,
                                                        warmup=False)]))
    with serve_on_loopback(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "tiny-wan did not load"
            time.sleep(0.05)
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_tiny_wan_end_to_end_an_adapter_changes_the_video(wan_server):
    client = wan_server
    asked = dict(prompt="a fox running", size="64x48", poll_interval_ms=50)
    extra = {"frames": 5, "seed": 4, "num_inference_steps": 2}  # Wan takes 4k+1 frames
    base = client.videos.create_and_poll(model="tiny-wan", extra_body=extra, **asked)
    styled = client.videos.create_and_poll(model="wan/motion", extra_body=extra, **asked)
    assert (base.status, styled.status) == ("completed", "completed"), (base.error, styled.error)
    base_frames, meta = read_mp4(client.videos.download_content(base.id).content)
    styled_frames, _ = read_mp4(client.videos.download_content(styled.id).content)
    assert base_frames.shape == styled_frames.shape == (5, 48, 64, 3)
    assert meta["codec"] == "h264" and meta["fps"] == 16 and base.seconds == "0.3125"  # Wan's 16 fps
    assert np.abs(base_frames.astype(int) - styled_frames.astype(int)).mean() > 1, "the adapter changes it"


@pytest.mark.slow
def test_a_video_with_no_model_on_a_server_hosting_tiny_sd_then_tiny_wan_is_made_by_tiny_wan():
    """The real engines: the image model first (the default), the video model second."""
    app = create_app(ServerConfig(engines=[EngineConfig(model=name, compile=False, warmup=False)
                                           for name in ("tiny-sd", "tiny-wan")]))
    with serve_on_loopback(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the models did not load"
            time.sleep(0.05)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        video = client.videos.create_and_poll(prompt="a fox running", size="64x48", poll_interval_ms=50,
                                              extra_body={"frames": 5, "seed": 4, "num_inference_steps": 2})
        frames, _ = read_mp4(client.videos.download_content(video.id).content)
        image = httpx.post(url + "/", json={"inputs": "a fox", "parameters": {"num_inference_steps": 1}}, timeout=60)
    assert (video.status, video.error, video.model) == ("completed", None, "tiny-wan")
    assert frames.shape == (5, 48, 64, 3) and image.status_code == 200
