"""A client that leaves stops its image at the next denoising step, whatever the API, on a real
`loraswap serve` (uvicorn): a request that would run for 30 s or more is stopped about a
step after its client goes, and the next request is served at once."""

import io
import threading
import time

import httpx
import pytest
from PIL import Image
from support.servers import ServerProcess

pytestmark = pytest.mark.slow  # a server, and a long request per API

STEPS = 200  # the most a request may ask for (`GenerateRequest`)
LONG_S = 30  # a long request runs at least this long


def stop_within(step_s: float) -> float:
    """Seconds a request may take to stop once its client left: the step it is on and the
    server's look (every 0.1 s), with room for steps that vary on a busy machine; far under
    the `LONG_S` it would run to its end."""
    return max(3 * step_s + 3, 8.0)

QUICK = {"inputs": "a blue square on black", "parameters": {"num_inference_steps": 2}}  # 32 px


def _body(path: str, size: int, steps: int) -> dict:
    """The httpx arguments of a request to `path` for a `size` x `size` image in `steps` steps."""
    if path == "/v1/images/edits":  # an input image of that size, repainted whole
        photo = io.BytesIO()
        Image.new("RGB", (size, size), (200, 40, 40)).save(photo, "PNG")
        return {"data": {"prompt": "a red circle", "num_inference_steps": str(steps), "strength": "1"},
                "files": {"image": ("photo.png", photo.getvalue(), "image/png")}}
    if path == "/v1/images/generations":
        return {"json": {"prompt": "a red circle", "size": f"{size}x{size}", "num_inference_steps": steps}}
    return {"json": {"inputs": "a red circle", "parameters": {"width": size, "height": size,
                                                               "num_inference_steps": steps}}}


PATHS = ["/", "/models/demo", "/v1/images/generations", "/v1/images/edits"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(["--model", "demo", "--max-size", "256x256", "--max-steps", str(STEPS), "--no-warmup"],
                            tmp_path_factory.mktemp("logs") / "client-leaves.log")
    process.wait_ready()
    yield process
    process.stop()


def _step_seconds(url: str, size: int) -> float:
    """One denoising step's seconds at `size` on this machine: the generate times (Server-Timing)
    of 6 steps less 2, over 4 (what else a call does, encoding the prompt and decoding, cancels)."""
    def generate_s(steps: int) -> float:
        response = httpx.post(url + "/", timeout=300, **_body("/", size, steps))
        assert response.status_code == 200, response.text
        timings = dict(item.strip().split(";dur=") for item in response.headers["server-timing"].split(","))
        return float(timings["generate"]) / 1e3

    return max(generate_s(6) - generate_s(2), 0.0) / 4


@pytest.fixture(scope="module")
def long(server) -> tuple[int, float]:
    """(size, seconds a step): the demo's own largest size (128 px), or 256 px on a machine fast
    enough that 200 steps of 128 px would not take `LONG_S`; a long request takes `STEPS` steps."""
    for size in (128, 256):
        step_s = _step_seconds(server.url, size)
        if STEPS * step_s >= LONG_S:
            return size, step_s
    pytest.fail(f"{STEPS} steps of {size} px take {STEPS * step_s:.1f} s: not long enough to show a stop")


def _leave_after(url: str, path: str, size: int, seconds: float) -> float:
    """Send a long request to `path` and leave (close the connection) after `seconds`; when it left."""
    try:
        httpx.post(url + path, timeout=httpx.Timeout(seconds, connect=10), **_body(path, size, STEPS))
    except httpx.TimeoutException:
        return time.monotonic()
    raise AssertionError(f"{path} answered within {seconds} s: no long request")


def _until(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` holds, polled every 0.05 s; fails past `timeout`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} not within {timeout:.1f} s"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.parametrize("path", PATHS)
def test_a_client_that_leaves_stops_its_image_at_the_next_step(server, long, path):
    size, step_s = long
    cancelled = server.metric("loraswap_cancelled_requests_total")
    _leave_after(server.url, path, size, 1.0)
    stopped_in = _until(lambda: server.metric("loraswap_cancelled_requests_total") == cancelled + 1,
                        stop_within(step_s), f"stopping {path}'s image ({step_s:.2f} s a step)")
    started = time.monotonic()
    quick = httpx.post(server.url + "/", json=QUICK, timeout=60)
    assert quick.status_code == 200 and time.monotonic() - started < 10, "the next request is served at once"
    assert server.metric("loraswap_queue_depth") == 0
    print(f"{path}: {size} px, {STEPS} steps of {step_s:.2f} s ({STEPS * step_s:.0f} s): stopped {stopped_in:.2f} s "
          "after its client left")


def test_a_queued_client_that_leaves_leaves_the_queue_at_once(server, long):
    """While another image runs: the queue does not count it (nor hold its adapters) until the
    worker comes round to it."""
    size, step_s = long
    cancelled = server.metric("loraswap_cancelled_requests_total")
    left = []
    first = threading.Thread(target=lambda: left.append(_leave_after(server.url, "/", size, 3 + 4 * step_s)))
    first.start()
    time.sleep(1.0)  # the first request is on the worker now
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/", json=QUICK, timeout=1.0)  # queued behind it, then its client leaves
    _until(lambda: server.metric("loraswap_queue_depth") == 0 and server.metric(
        "loraswap_cancelled_requests_total") == cancelled + 1, 2, "leaving the queue while the first still runs")
    first.join()
    assert left, "the first request was still running when the queued one left"
    _until(lambda: server.metric("loraswap_cancelled_requests_total") == cancelled + 2, stop_within(step_s),
           "stopping the first")
