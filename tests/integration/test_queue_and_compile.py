"""The GPU worker's queue (503, disconnects) and a compiled server that never recompiles."""

import threading
import time

import httpx
import pytest
from support.servers import ServerProcess

pytestmark = pytest.mark.slow  # compiles, and fills queues of real servers

# about 6 s of a CPU core each: long enough for the queue to fill and a client to leave while it runs
# (384 px: the servers below raise tiny-sd's largest size, 128 px by default, with --max-size)
SLOW = {"inputs": "a slow one", "parameters": {"width": 384, "height": 384, "num_inference_steps": 40}}


@pytest.fixture(scope="module")
def small_queue_server(served_adapters, tmp_path_factory):
    process = ServerProcess(["--model", "tiny-sd", "--adapters", str(served_adapters), "--max-queue", "1",
                             "--max-width", "512", "--max-height", "512", "--max-size", "512x512"],
                            tmp_path_factory.mktemp("logs") / "queue.log")
    process.wait_ready()
    yield process
    process.stop()


def test_full_queue_answers_503_with_retry_after(small_queue_server):
    url = small_queue_server.url
    responses = []

    def post():
        responses.append(httpx.post(url + "/", json=SLOW, timeout=120))

    threads = [threading.Thread(target=post) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 503]
    assert statuses.count(200) >= 1 and len(refused) >= 2, statuses
    assert set(statuses) <= {200, 503}
    for r in refused:
        assert r.headers["retry-after"] == "2" and "queue is full" in r.json()["error"]
    assert small_queue_server.metric("loraswap_queue_depth") == 0


def test_client_gone_while_queued_costs_no_gpu_work(small_queue_server):
    url = small_queue_server.url
    cancelled_before = small_queue_server.metric("loraswap_cancelled_requests_total")
    first = threading.Thread(target=lambda: httpx.post(url + "/", json=SLOW, timeout=120))
    first.start()
    time.sleep(0.5)  # the first request is now on the worker
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/", json=SLOW, timeout=1.0)  # queued behind it, then the client leaves
    first.join()
    deadline = time.monotonic() + 10
    while small_queue_server.metric("loraswap_cancelled_requests_total") == cancelled_before:
        assert time.monotonic() < deadline, "the abandoned request was never skipped"
        time.sleep(0.1)
    assert small_queue_server.metric("loraswap_cancelled_requests_total") == cancelled_before + 1
    assert small_queue_server.metric("loraswap_requests_total", '{route="/",status="499"}') == 1
    log = small_queue_server.log()
    assert "unhandled error" not in log and "never retrieved" not in log, "a client leaving is no error"


def test_compiled_server_swaps_without_recompiling(adapter_factory, tmp_path_factory):
    root = adapter_factory.root / "compiled-server"
    specs = [(4, "attn", "diffusers"), (64, "all", "kohya"), (16, "all", "diffusers"), (128, "attn", "kohya"),
             (8, "all", "diffusers")]
    for i, (rank, targets, fmt) in enumerate(specs):
        adapter_factory(f"f{i}", "tiny-flux", rank=rank, targets=targets, fmt=fmt, text_encoder=i == 2,
                        alpha=4.0 * rank, seed=60 + i, folder=root)
    process = ServerProcess(["--model", "tiny-flux", "--adapters", str(root), "--compile"],
                            tmp_path_factory.mktemp("logs") / "compiled.log", env={"TORCH_LOGS": "recompiles"})
    try:
        process.wait_ready()
        bodies = set()
        for i in range(10):
            response = httpx.post(process.url + "/", json={"inputs": "a fox", "parameters": {"seed": 1}},
                                  headers={"lora": f"f{i % 5}", "accept": "image/png"}, timeout=120)
            assert response.status_code == 200, response.text
            bodies.add(response.content)
        assert len(bodies) == 5, "each adapter gives its own image, and the same one each time"
        assert process.metric("loraswap_recompiles_total") == 0
        assert process.metric("loraswap_adapter_swap_seconds_count") == 10
    finally:
        process.stop()
    log = process.log()
    assert "warming up (compiling)" in log
    # warm-up may specialise a block twice (input strides); after "ready", nothing may compile
    serving = log.split("ready: tiny-flux", 1)[1]
    assert "Recompiling" not in serving and "__recompiles" not in serving, serving


def test_sigterm_finishes_in_flight_requests_and_exits_0(served_adapters, tmp_path):
    # the drain time (queued requests refused, running ones given that long) longer than SLOW takes
    process = ServerProcess(["--model", "tiny-sd", "--adapters", str(served_adapters), "--max-width", "512",
                             "--max-height", "512", "--max-size", "512x512", "--drain-s", "120"],
                            tmp_path / "sigterm.log")
    process.wait_ready()
    responses = []
    inflight = threading.Thread(target=lambda: responses.append(httpx.post(process.url + "/", json=SLOW,
                                                                           timeout=120)))
    inflight.start()
    time.sleep(0.5)  # on the worker now
    process.proc.terminate()
    inflight.join()
    assert process.proc.wait(60) == 0
    assert responses and responses[0].status_code == 200, "the in-flight request was finished"
    with pytest.raises(httpx.HTTPError):
        httpx.post(process.url + "/", json={"inputs": "x"}, timeout=5)
    process.stop()
