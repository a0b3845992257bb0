"""A real `loraswap serve` process of tiny-wan killed with SIGKILL and started again on the
same --state-dir: the completed video downloads with the same SHA-256, and the one it was
making completes after the restart."""

import hashlib
import time

import pytest
from openai import OpenAI
from support.servers import ServerProcess

SIZE = "64x48"


def client_of(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def wait_for(client: OpenAI, video_id: str, statuses: set[str], timeout: float):
    deadline = time.monotonic() + timeout
    while (video := client.videos.retrieve(video_id)).status not in statuses:
        assert time.monotonic() < deadline, video
        time.sleep(0.1)
    return video


@pytest.mark.slow
def test_a_killed_server_keeps_its_finished_video_and_finishes_the_one_it_was_making(tmp_path):
    args = ["--model", "tiny-wan", "--no-warmup", "--no-compile", "--state-dir", str(tmp_path / "state")]
    first = ServerProcess(args, tmp_path / "first.log")
    try:
        first.wait_ready()
        client = client_of(first)
        done = client.videos.create_and_poll(model="tiny-wan", prompt="a fox running", size=SIZE, poll_interval_ms=50,
                                             extra_body={"frames": 5, "seed": 4, "num_inference_steps": 2})
        assert done.status == "completed", done.error
        digest = hashlib.sha256(client.videos.download_content(done.id).content).hexdigest()
        # many steps: still being made when the server dies
        slow = client.videos.create(model="tiny-wan", prompt="a slow river", size=SIZE,
                                    extra_body={"frames": 5, "seed": 5, "num_inference_steps": 12})
        wait_for(client, slow.id, {"in_progress"}, 60)
        first.proc.kill()
    finally:
        first.stop()
    second = ServerProcess(args, tmp_path / "second.log")
    try:
        second.wait_ready()
        client = client_of(second)
        again = client.videos.retrieve(done.id)
        content = client.videos.download_content(done.id).content
        finished = wait_for(client, slow.id, {"completed", "failed"}, 120)
        slow_mp4 = client.videos.download_content(slow.id).content if finished.status == "completed" else b""
    finally:
        second.stop()
    assert (again.status, again.completed_at, again.expires_at) == ("completed", done.completed_at, done.expires_at)
    assert hashlib.sha256(content).hexdigest() == digest, "the same bytes after the crash"
    assert finished.status == "completed", finished.error
    assert (finished.created_at, finished.seconds, finished.size, len(slow_mp4) > 0) == (
        slow.created_at, "0.3125", SIZE, True)  # 5 frames at Wan's 16 fps
    assert f"making video {slow.id} again" in second.log()
