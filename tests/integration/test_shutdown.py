"""SIGTERM on a real `loraswap serve`: a queued request gets a JSON 503 at once, the running one
has the drain time, then stops at its next step (a JSON 503 too), and the process exits right
after, with code 0 and no traceback."""

import signal
import threading
import time

import httpx
import pytest
from support.servers import ServerProcess

pytestmark = pytest.mark.slow  # a server started and stopped

DRAIN_S = 4.0
LONG = {"inputs": "a red circle", "parameters": {"width": 128, "height": 128, "num_inference_steps": 200}}
QUICK = {"inputs": "a blue square on black", "parameters": {"num_inference_steps": 2}}


def _post(url: str, body: dict, answers: dict, name: str) -> None:
    """POST `body`, recording (when answered, the response) under `name`."""
    response = httpx.post(url + "/", json=body, timeout=120)
    answers[name] = (time.monotonic(), response)


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


def test_sigterm_answers_the_queued_at_once_and_stops_the_running_after_the_drain(tmp_path):
    server = ServerProcess(["--model", "demo", "--no-warmup", "--max-steps", "200", "--drain-s", str(DRAIN_S)],
                           tmp_path / "shutdown.log")
    server.wait_ready()
    answers: dict = {}
    clients = [threading.Thread(target=_post, args=(server.url, LONG, answers, "running"))]
    clients[0].start()
    time.sleep(1.5)  # on the worker now
    clients.append(threading.Thread(target=_post, args=(server.url, QUICK, answers, "queued")))
    clients[1].start()
    _until(lambda: server.metric("loraswap_queue_depth") == 1, 10, "the second request queued")

    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for client in clients:
        client.join(60)
    code = server.proc.wait(30)
    exited = time.monotonic()
    server.stop()
    log = server.log()

    queued_at, queued = answers["queued"]
    assert queued.status_code == 503 and queued.headers["content-type"] == "application/json", queued.text
    assert "shutting down" in queued.json()["error"] and queued.headers["retry-after"]
    assert queued_at - signalled < 2.0, "the queued request is answered at once, not after the drain"
    running_at, running = answers["running"]
    assert running.status_code == 503 and running.headers["content-type"] == "application/json", running.text
    assert "stopped at step" in running.json()["error"]
    assert DRAIN_S - 0.5 <= running_at - signalled <= DRAIN_S + 15, "given the drain time, then stopped at a step"
    # then the interpreter's own teardown (its last collections over torch's objects: seconds on a busy machine)
    assert code == 0 and exited - running_at < 10.0, "the process exits once its last request is answered"
    for bad in ("Traceback", "timeout graceful shutdown exceeded", "Exception in ASGI application",
                "Internal Server Error"):
        assert bad not in log, log
    print(f"\nqueued answered {queued_at - signalled:.2f} s after SIGTERM, running {running_at - signalled:.2f} s "
          f"({running.json()['error']}), exited {exited - signalled:.2f} s after")
