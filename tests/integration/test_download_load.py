"""Downloads under load, against a real `loraswap serve` process: a plain request is as quick
while 40 clients wait on a URL that drips bytes (downloads run on a pool of their own), and
16 clients each naming a distinct 3 MiB URL under --download-cache-gb 0.01 get no 500, five
rounds running, the folder never over its budget. Run with -s for the figures."""

import fcntl
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from support.servers import ServerProcess
from support.web import Web, body, drip

PARAMETERS = {"width": 64, "height": 64, "seed": 7, "num_inference_steps": 2}
BUDGET_GB = 0.01


def _post(url: str, *paths: str, timeout: float = 120) -> httpx.Response:
    loras = {"loras": [{"path": path} for path in paths]} if paths else {}
    return httpx.post(url + "/", json={"inputs": "a lighthouse", "parameters": {**PARAMETERS, **loras}},
                      timeout=timeout)


def _plain_seconds(url: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        assert _post(url, timeout=60).status_code == 200
        times.append(time.perf_counter() - started)
    return times


@pytest.mark.load
def test_a_plain_request_does_not_wait_behind_forty_clients_naming_a_dripping_url(adapter_factory, tmp_path):
    """p50 of a plain request (no adapter) alone, and while 40 clients name a URL that drips a byte
    a second (--download-timeout-s 120): within 1.5x. Measured in turns (alone, then with the 40,
    four times over, a new dripping URL each turn) so that the machine's drift hits both alike."""
    style = adapter_factory("style", "tiny-sd", rank=8, seed=31, folder=tmp_path / "a").read_bytes()
    web = Web({})
    server = ServerProcess(["--model", "tiny-sd", "--url-allow", f"127.0.0.1:{web.port}", "--download-timeout-s",
                            "120", "--download-dir", str(tmp_path / "downloads"), "--max-queue", "256"],
                           tmp_path / "server.log")
    alone, during, statuses = [], [], set()
    try:
        server.wait_ready()
        _plain_seconds(server.url, 5)  # warm
        with ThreadPoolExecutor(40) as pool:
            for turn in range(4):
                alone += _plain_seconds(server.url, 6)
                stop, path = threading.Event(), f"/drip{turn}.safetensors"
                web.routes[path] = drip(web, style[:64], len(style), 1.0, stop=stop)
                waiting = [pool.submit(_post, server.url, web.url(path), timeout=180) for _ in range(40)]
                deadline = time.monotonic() + 30
                while path not in web.paths():
                    assert time.monotonic() < deadline, server.log()
                    time.sleep(0.05)
                time.sleep(0.5)  # all 40 are in
                during += _plain_seconds(server.url, 6)
                assert not any(f.done() for f in waiting), "the 40 waited on the drip all along"
                stop.set()  # the host hangs up: the 40 are answered
                statuses |= {f.result().status_code for f in waiting}
    finally:
        web.close()
        server.stop()
    p50_alone, p50_during = statistics.median(alone), statistics.median(during)
    print(f"\nplain request p50: alone {p50_alone * 1000:.0f} ms, with 40 clients on a dripping URL "
          f"{p50_during * 1000:.0f} ms ({p50_during / p50_alone:.2f}x); {len(alone)} requests each")
    assert statuses == {502}, "the 40 got the upstream's failure once it hung up"
    assert p50_during < 1.5 * p50_alone, (alone, during)


class FolderPeak:
    """The download folder's bytes (reservations included), sampled every ms under the folder's lock
    (the moments between the cache's decisions): their peak."""

    def __init__(self, folder):
        self.folder, self.peak = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.001):
            if not self.folder.is_dir():
                continue
            sizes = {}
            fd = os.open(self.folder, os.O_RDONLY)
            try:  # a snapshot: the server's download cache changes the folder only under this lock
                fcntl.flock(fd, fcntl.LOCK_SH)
                for entry in os.scandir(self.folder):
                    try:
                        sizes[entry.stat().st_ino] = entry.stat().st_size
                    except FileNotFoundError:
                        continue
            finally:
                os.close(fd)
            self.peak = max(self.peak, sum(sizes.values()))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.mark.load
def test_sixteen_clients_naming_distinct_3_mib_urls_under_a_tiny_budget_get_no_500(adapter_factory, tmp_path):
    """--download-cache-gb 0.01 (three such files fit), 16 clients at once, each a distinct 3 MiB
    URL, five rounds of new URLs: every answer a 200 (none the 500 of a file dropped under a
    request), the folder never over its budget, and the server still serving."""
    adapter = adapter_factory("three-mib", "tiny-sd", rank=85, targets="all", dtype=torch.float32, seed=5,
                              folder=tmp_path / "a").read_bytes()
    assert 2.9 * 2**20 < len(adapter) < 3.1 * 2**20
    web = Web({f"/r{r}/{i}.safetensors": body(adapter) for r in range(5) for i in range(16)})
    downloads = tmp_path / "downloads"
    server = ServerProcess(["--model", "tiny-sd", "--url-allow", f"127.0.0.1:{web.port}", "--download-cache-gb",
                            str(BUDGET_GB), "--download-dir", str(downloads), "--max-queue", "64"],
                           tmp_path / "server.log")
    statuses = []
    try:
        server.wait_ready()
        with FolderPeak(downloads) as folder, ThreadPoolExecutor(16) as pool:
            for r in range(5):
                answers = list(pool.map(lambda i, r=r: _post(server.url, web.url(f"/r{r}/{i}.safetensors")),
                                        range(16)))
                statuses.append([a.status_code for a in answers])
        plain = _post(server.url)
    finally:
        web.close()
        server.stop()
    fives = sum(status >= 500 for round_ in statuses for status in round_)
    print(f"\nrace test: 5 rounds x 16 clients, distinct 3 MiB URLs, --download-cache-gb {BUDGET_GB}: "
          f"{fives} answers of 5xx of 80; statuses {statuses}; folder peak {folder.peak / 2**20:.2f} MiB "
          f"of {BUDGET_GB * 2**30 / 2**20:.2f} MiB")
    assert statuses == [[200] * 16] * 5, server.log()[-4000:]
    assert "Traceback" not in server.log()
    assert folder.peak <= BUDGET_GB * 2**30
    assert plain.status_code == 200
