"""A `loraswap serve` of tiny-wan killed with SIGKILL while a queued video job's URL adapter
downloads: after the restart the job is made again, its adapter fetched again by its URL
(signature and all), not failed `server_restarted`; the dead process's partial and lock
files are cleaned, and no log shows the URL's signature."""

import json
import threading
import time

import pytest
from openai import OpenAI
from support.servers import ServerProcess
from support.web import Web, send

SIZE = "64x48"


def _first_hangs(web: Web, data: bytes, first_started: threading.Event):
    """The first request gets the headers and 100 bytes, then nothing until the server closes; the
    next ones the whole file."""
    def route(handler):
        if first_started.is_set():
            send(handler, 200, data)
            return
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data[:100])
        handler.wfile.flush()
        first_started.set()
        web.stop.wait(600)
    return route


@pytest.mark.slow  # two tiny-wan servers
def test_a_video_job_killed_while_its_url_adapter_downloads_is_made_again(tmp_path, adapter_factory):
    data = adapter_factory("wan-style", "tiny-wan", rank=4, seed=7, folder=tmp_path / "adapters").read_bytes()
    started = threading.Event()
    web = Web({})
    web.routes["/wan.safetensors"] = _first_hangs(web, data, started)
    url = web.url("/wan.safetensors?X-Signature=SECRET")
    downloads = tmp_path / "downloads"
    args = ["--model", "tiny-wan", "--no-warmup", "--no-compile", "--state-dir", str(tmp_path / "state"),
            "--download-dir", str(downloads), "--url-allow", f"127.0.0.1:{web.port}"]
    first = ServerProcess(args, tmp_path / "first.log")
    try:
        first.wait_ready()
        client = OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        job = client.videos.create(model="tiny-wan", prompt="a fox running", size=SIZE, extra_body={
            "frames": 5, "seed": 4, "num_inference_steps": 2, "loras": json.dumps([{"path": url, "scale": 0.8}])})
        assert started.wait(60), "its adapter's download started"
        assert client.videos.retrieve(job.id).status == "queued"
        assert any(p.name.startswith(".partial-") for p in downloads.iterdir())
        first.proc.kill()
    finally:
        first.stop()
    second = ServerProcess(args, tmp_path / "second.log")
    try:
        second.wait_ready()
        client = OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while (video := client.videos.retrieve(job.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, video
            time.sleep(0.1)
        content = client.videos.download_content(job.id).content if video.status == "completed" else b""
    finally:
        second.stop()
        web.close()
    assert video.status == "completed", video.error
    assert (video.created_at, video.size, len(content) > 0) == (job.created_at, SIZE, True)
    assert web.paths().count("/wan.safetensors?X-Signature=SECRET") == 2, "fetched again, signature and all"
    left = sorted(p.name for p in downloads.iterdir())
    assert not any(name.startswith((".partial-", ".lock-")) for name in left), left
    assert f"making video {job.id} again" in second.log()
    assert "SECRET" not in first.log() + second.log()
