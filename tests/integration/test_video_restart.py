"""A real `loraswap serve` process of tiny-wan killed with SIGKILL and started again on the
same --state-dir: the completed video downloads with the same SHA-256, the one it was
making completes after the restart, the adapter it was told to keep is kept again, and
DELETE of a job removes its files; SIGTERM stops a video being made and leaves it for the
next start."""

import hashlib
import sqlite3
import time

import httpx
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


def _kept(url: str, adapter_id: str, timeout: float) -> bool:
    """Whether the server lists the adapter as kept within `timeout` (it is kept again in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = httpx.get(url + "/adapters", timeout=10).json()["adapters"]
        if any(row["id"] == adapter_id and row["kept"] for row in rows):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_killed_server_keeps_its_finished_video_and_finishes_the_one_it_was_making(tmp_path, adapter_factory):
    adapter_factory("keep-me", "tiny-wan", rank=4, seed=61, folder=tmp_path / "adapters")
    args = ["--model", "tiny-wan", "--no-warmup", "--no-compile", "--state-dir", str(tmp_path / "state"),
            "--adapters", str(tmp_path / "adapters"), "--max-size", "512x512"]  # the long video: over tiny-wan's 128
    first = ServerProcess(args, tmp_path / "first.log")
    try:
        first.wait_ready()
        assert httpx.post(first.url + "/adapters/keep-me/load", timeout=60).status_code == 200
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
        kept_again = _kept(second.url, "keep-me", 60)
        files = tmp_path / "state" / "videos"
        had_files = sorted(p.name for p in files.glob(f"{done.id}.*"))
        client.videos.delete(done.id)
        left = sorted(p.name for p in files.glob(f"{done.id}.*"))
        # SIGTERM while a long video is made: it stops at its next step, and stays for the next start
        longest = client.videos.create(model="tiny-wan", prompt="a long river", size="512x512",
                                       extra_body={"frames": 65, "seed": 6, "num_inference_steps": 100})
        wait_for(client, longest.id, {"in_progress"}, 60)
    finally:
        stopped = second.stop()
    with sqlite3.connect(tmp_path / "state" / "videos.sqlite3") as db:
        left_unfinished = db.execute("SELECT finished_at FROM videos WHERE id = ?", (longest.id,)).fetchall()
    assert stopped == 0 and left_unfinished == [(None,)], "stopped mid-way, not made to its 100th step"
    assert f"video {longest.id}: stopping it for the server's shutdown" in second.log()
    assert had_files == [f"{done.id}.{ext}" for ext in ("json", "mp4", "png")] and left == [], (
        "DELETE removes the job's files")
    assert kept_again, "the adapter kept before the crash is kept again"
    assert (again.status, again.completed_at, again.expires_at) == ("completed", done.completed_at, done.expires_at)
    assert hashlib.sha256(content).hexdigest() == digest, "the same bytes after the crash"
    assert finished.status == "completed", finished.error
    assert (finished.created_at, finished.seconds, finished.size, len(slow_mp4) > 0) == (
        slow.created_at, "0.3125", SIZE, True)  # 5 frames at Wan's 16 fps
    assert f"making video {slow.id} again" in second.log()
