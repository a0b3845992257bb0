"""Soak: a server with no URL flags at all, 4,000 requests of `POST /` whose `parameters.loras`
names 31 distinct 2,000-character URLs (124,000 URLs in all): each is refused with 403, and
the server's resident memory grows less than 20 MiB (keeping every URL it parsed, it grew
about 50 KB a request, never released: 200 MB).

Run with -s to see the figure."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.servers import ServerProcess

REQUESTS = 4000
WARM_UP = 200  # the allocator's pools and the server's caches filled first
URLS_PER_REQUEST = 31
URL_CHARS = 2000
MAX_GROWTH_MIB = 20


def rss_mib(pid: int) -> float:
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def body(request: int) -> bytes:
    urls = []
    for i in range(URLS_PER_REQUEST):
        tail = f"/{request:06d}-{i:02d}.safetensors?X-Amz-Signature=SECRET"
        urls.append("https://cdn.example.com/" + "x" * (URL_CHARS - len(tail) - 24) + tail)
    return json.dumps({"inputs": "a fox", "parameters": {"num_inference_steps": 1,
                                                         "loras": [{"path": url} for url in urls]}}).encode()


@pytest.mark.soak
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
def test_refused_urls_do_not_grow_the_servers_memory(tmp_path):
    server = ServerProcess(["--model", "tiny-sd", "--no-compile", "--no-warmup", "--download-dir",
                            str(tmp_path / "downloads")], tmp_path / "server.log")
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"content-type": "application/json"}) as client:
            def send(request: int) -> int:
                answer = client.post("/", content=body(request))
                assert "does not fetch adapters from url references" in answer.text, answer.text
                return answer.status_code

            with ThreadPoolExecutor(4) as pool:
                assert set(pool.map(send, range(WARM_UP))) == {403}
                before = rss_mib(server.proc.pid)
                assert set(pool.map(send, range(WARM_UP, WARM_UP + REQUESTS))) == {403}
                after = rss_mib(server.proc.pid)
            fine = client.post("/", content=json.dumps({"inputs": "a fox", "parameters": {"num_inference_steps": 1}}))
            assert fine.status_code == 200, "the server still serves"
        growth = after - before
        print(f"\nRSS after {REQUESTS} refused requests of {URLS_PER_REQUEST} distinct {URL_CHARS}-character URLs: "
              f"{before:.1f} MiB -> {after:.1f} MiB ({growth:+.1f} MiB)")
        assert growth < MAX_GROWTH_MIB, f"the server's RSS grew {growth:.1f} MiB"
        assert "SECRET" not in server.log()
    finally:
        server.stop()
