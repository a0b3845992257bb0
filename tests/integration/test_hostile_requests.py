"""Hostile requests against a real server on loopback (tiny-sd and tiny-wan, two API keys):
each is answered with a 4xx that says what to fix, the server goes on serving, and both
models are bitwise as they were. A 500 keeps its connection and is logged once; a deleted
video stops generating; a video job belongs to the key that made it."""

import base64
import http.client
import io
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image
from support.errors import error_message
from support.fakes import serve_on_loopback
from support.images import encode, noise, png16_rgba
from support.numerics import assert_bitwise_equal, weights_snapshot
from support.servers import ServerProcess, form

from loraswap.engine.config.engine import EngineConfig
from loraswap.server.app import create_app
from loraswap.server.config import ServerConfig

ONE, TWO = ({"authorization": "Bearer key-one"}, {"authorization": "Bearer key-two"})
PICTURE = encode(noise(64, 64))


@pytest.fixture(scope="module")
def served():
    engines = [EngineConfig(model="tiny-sd", compile=False, warmup=False),
               EngineConfig(model="tiny-wan", compile=False, warmup=False)]
    app = create_app(ServerConfig(engines=engines, api_keys=["key-one", "key-two"], max_video_jobs_pending=1))
    with serve_on_loopback(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the models did not load"
            time.sleep(0.05)
        yield url, app


def components(app) -> dict:
    return {f"{h.engine.model_name}.{name}": module for h in app.state.deployment.hosted
            for name, module in h.engine.components.items()}


@pytest.fixture
def server(served):
    """The server; after the test it still generates, and every weight is as before."""
    url, app = served
    before = weights_snapshot(components(app))
    yield url, app
    fine = httpx.post(url + "/", headers=ONE, json={"inputs": "a fox", "parameters": {"num_inference_steps": 1}},
                      timeout=60)
    assert fine.status_code == 200, fine.text
    assert_bitwise_equal(before, components(app))


def raw(url: str, path: str, body: bytes, headers=ONE) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={**headers, "content-type": "application/json"}, timeout=60)


DEEP = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize("path,body,phrase", [
    ("/", b'{"inputs": "a \\ud800 cat"}', r"prompt holds '\ud800', half of a UTF-16 pair"),
    ("/", b'{"inputs": "a cat", "parameters": {"negative_prompt": "\\udfff"}}', "negative_prompt holds"),
    ("/v1/images/generations", b'{"prompt": "a \\udbff cat"}', "prompt holds"),
    ("/", b'{"inputs": "x", "parameters": ' + DEEP + b"}", "nested too deep"),
    ("/v1/images/generations", b'{"prompt": ' + DEEP + b"}", "nested too deep"),
    ("/", b'{"inputs": "x", "parameters": {"seed": ' + b"7" * 5000 + b"}}", "the body must be JSON"),
    ("/", json.dumps({"inputs": base64.b64encode(PICTURE).decode(),
                      "parameters": {"prompt": "x", "strength": 0.2, "num_inference_steps": 1}}).encode(),
     "strength 0.2 x 1 steps is 0.2, under the one denoising step an image input needs: ask for a strength of at "
     "least 1, or at least 5 steps"),
])
def test_bad_json_bodies_are_refused_saying_what_to_fix(server, path, body, phrase):
    url, _ = server
    response = raw(url, path, body)
    assert response.status_code == 400, response.text
    assert phrase in error_message(response)


def test_an_edit_whose_strength_leaves_no_step_is_refused(server):
    url, _ = server
    response = httpx.post(url + "/v1/images/edits", headers=ONE, files={"image": ("a.png", PICTURE, "image/png")},
                          data={"prompt": "x", "strength": "1e-9", "num_inference_steps": "4"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "strength 1e-09 x 4 steps" in response.json()["error"]["message"]
    assert "or at least" not in response.json()["error"]["message"], "1e9 steps is no advice"


@pytest.mark.parametrize("fields,status,phrase", [
    ({"seconds": "1e308"}, 400, "seconds 1e+308 must be more than 0 and at most 121"),
    ({"size": "72x48"}, 422, "tiny-wan needs a width that is a multiple of 16, not 72"),
])
def test_bad_videos_are_refused_before_a_job_is_made(server, fields, status, phrase):
    url, app = server
    response = httpx.post(url + "/v1/videos", headers=ONE, files=form(prompt="x", model="tiny-wan", **fields))
    assert response.status_code == status, response.text
    assert phrase in response.json()["error"]["message"]
    assert len(app.state.videos) == 0


def test_an_unexpected_error_keeps_the_connection_and_is_logged_once(server, monkeypatch, caplog):
    url, app = server
    monkeypatch.setattr(app.state.deployment.hosted[0].engine, "generate_batch", lambda *a, **k: 1 / 0)
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to caplog's
    uvicorn_log.addHandler(caplog.handler)
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    body = json.dumps({"inputs": "x", "parameters": {"num_inference_steps": 1}})
    try:
        with caplog.at_level(logging.ERROR):
            connection.request("POST", "/", body, {**ONE, "content-type": "application/json"})
            failed = connection.getresponse()
            assert (failed.status, json.loads(failed.read())) == (500, {"error": "internal server error"})
            assert failed.getheader("connection") != "close"
        monkeypatch.undo()
        connection.request("POST", "/", body, {**ONE, "content-type": "application/json"})  # the same socket
        again = connection.getresponse()
        assert again.status == 200 and again.read()
    finally:
        connection.close()
        uvicorn_log.removeHandler(caplog.handler)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "ZeroDivisionError" in caplog.text


def video(url: str, headers=ONE, **fields) -> dict:
    response = httpx.post(url + "/v1/videos", headers=headers,
                          files=form(prompt="a fox", model="tiny-wan", size="32x32", frames=5, **fields))
    assert response.status_code == 200, response.text
    return response.json()


def poll(url: str, video_id: str, status: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while (view := httpx.get(f"{url}/v1/videos/{video_id}", headers=ONE).json())["status"] != status:
        assert time.monotonic() < deadline, view
        time.sleep(0.02)
    return view


def test_a_deleted_video_stops_at_its_next_step_and_the_worker_takes_the_next_job(server):
    url, app = server
    worker = app.state.deployment.by_name("tiny-wan").worker
    stopped, completed = worker.stopped, worker.completed
    job = video(url, num_inference_steps="100")
    poll(url, job["id"], "in_progress")
    assert httpx.delete(f"{url}/v1/videos/{job['id']}", headers=ONE).json()["deleted"] is True
    deadline = time.monotonic() + 60
    while worker.stopped == stopped:  # at its next step, not after 100
        assert time.monotonic() < deadline, "the deleted video was not stopped"
        time.sleep(0.02)
    assert worker.completed == completed + 1
    done = poll(url, video(url, num_inference_steps="2")["id"], "completed")  # the pending cap of 1 is free
    assert done["progress"] == 100


def test_a_video_job_belongs_to_the_key_that_made_it(server):
    url, _ = server
    job = video(url, num_inference_steps="1")
    for ask in (httpx.get, httpx.delete):
        assert ask(f"{url}/v1/videos/{job['id']}", headers=TWO).status_code == 404
    assert httpx.get(f"{url}/v1/videos/{job['id']}/content", headers=TWO).status_code == 404
    poll(url, job["id"], "completed")
    assert httpx.get(f"{url}/v1/videos/{job['id']}/content", headers=ONE).status_code == 200
    assert httpx.delete(f"{url}/v1/videos/{job['id']}", headers=ONE).status_code == 200


def status_mb(pid: int, field: str) -> float:
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@pytest.mark.slow  # a server of its own, and 32 decodes of 4096² images
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's peak RSS from /proc")
def test_sixteen_huge_images_at_once_stay_within_the_decode_budget(tmp_path):
    """16 edits at once, each a 4096² 16-bit RGBA image and mask in a ~270 KB body: a server with
    a 512 MiB decode budget peaks within it (unbounded, the same requests took it up 3 GB)."""
    budget_mb = 512
    server = ServerProcess(["--model", "tiny-sd", "--max-queue", "64", "--auto-size-max-pixels", "4096",
                            "--max-decode-mb", str(budget_mb)], tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"inputs": "x", "parameters": {"num_inference_steps": 1}}
        assert httpx.post(server.url + "/", json=body, timeout=60).status_code == 200
        before = status_mb(server.proc.pid, "VmHWM")
        huge = png16_rgba(4096, 4096)

        def edit(_):
            return httpx.post(server.url + "/v1/images/edits", data={"prompt": "x", "num_inference_steps": "1"},
                              files={"image": ("i.png", huge, "image/png"), "mask": ("m.png", huge, "image/png")},
                              timeout=300)

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(edit, range(16)))
        assert [a.status_code for a in answers] == [200] * 16, answers[0].text
        assert Image.open(io.BytesIO(base64.b64decode(answers[0].json()["data"][0]["b64_json"]))).size == (64, 64)
        peak = status_mb(server.proc.pid, "VmHWM") - before
        assert peak < budget_mb * 1.049 + 250, f"the server's peak RSS grew {peak:.0f} MB"
    finally:
        server.stop()
