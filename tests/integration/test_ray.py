"""loraswap on Ray Serve: adapter affinity, a replica's adapter budget, routing at the ingress,
a killed replica, graceful stop.

One cluster for the module: `loraswap deploy CONFIG.yaml` in a subprocess (its own local
Ray) with tiny-sd on 2 replicas (8 adapters each) and tiny-sdxl on 1 replica (2 adapters).
Everything is observed over HTTP: `/replicas` (loads, evictions, held adapter sets, pids),
`/adapters` (which replicas cache each adapter) and `/metrics`.
"""

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.servers import ServerProcess, free_port, ray_env

pytestmark = pytest.mark.ray

SD = "model-tiny-sd"
XL = "model-tiny-sdxl"
SD_IDS = [f"sd/{i}" for i in range(6)]
XL_IDS = ["xl/a", "xl/b", "xl/c"]


@pytest.fixture(scope="module")
def cluster(adapter_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-adapters")
    for i, adapter_id in enumerate([*SD_IDS, "hot"]):
        adapter_factory(adapter_id, "tiny-sd", rank=4, seed=800 + i, folder=root)
    for i, adapter_id in enumerate(XL_IDS):
        adapter_factory(adapter_id, "tiny-sdxl", rank=4, base_model="tiny-sdxl", seed=810 + i, folder=root)
    adapter_factory("flux-only", "tiny-flux", rank=4, base_model="tiny-flux", seed=820, folder=root)
    port = free_port()
    config = {"port": port, "max_steps": 60, "report_interval_s": 0.25, "engines": [
        {"model": "tiny-sd", "adapters": str(root), "replicas": 2, "max_adapters": 8, "health_check_period_s": 1},
        {"model": "tiny-sdxl", "adapters": str(root), "replicas": 1, "max_adapters": 2}]}
    path = tmp_path_factory.mktemp("ray") / "loraswap.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    process = ServerProcess([str(path)], path.with_suffix(".log"), env=ray_env(), command="deploy", port=port)
    process.wait_ready()
    yield process
    process.stop()


def generate(url: str, lora: str | None, steps: int = 2, seed: int = 1) -> httpx.Response:
    return httpx.post(url + "/", json={"inputs": "a fox", "parameters": {"seed": seed, "num_inference_steps": steps}},
                      headers={"lora": lora} if lora else {}, timeout=120)


def replicas(url: str, deployment: str, alive: bool = True) -> list[dict]:
    rows = httpx.get(url + "/replicas").json()["replicas"]
    return [r for r in rows if r["deployment"] == deployment and (r["alive"] or not alive)]


def adapters(url: str) -> dict[str, dict]:
    return {row["id"]: row for row in httpx.get(url + "/adapters").json()["adapters"]}


def wait_for(condition, timeout: float = 15.0, what: str = ""):
    """Replicas report every 0.25 s: poll until `condition()` is truthy, and return it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_each_adapter_is_loaded_on_one_replica_only(cluster):
    url = cluster.url
    for i in range(60):  # sequential, the 6 adapters in turn
        response = generate(url, SD_IDS[i % 6], seed=i)
        assert response.status_code == 200, response.text
    sd = wait_for(lambda: (rows := replicas(url, SD)) and sum(r["served"] for r in rows) == 60 and rows,
                  what="reports of 60 requests")
    loads = {r["replica"]: r["loads"] for r in sd}
    print("loads per replica:", loads, "served per replica:", {r["replica"]: r["served"] for r in sd})
    assert len(sd) == 2
    # what each model takes and makes reaches /ready from its replicas (the playground builds its form from it)
    capabilities = httpx.get(url + "/ready").json()["capabilities"]
    assert capabilities["tiny-sd"]["image_input"] == "variants" and capabilities["tiny-sdxl"]["masks"]
    # where each runs: no GPU here, so Ray gave none and the engine is on the CPU
    assert all(r["device"] == "cpu" and r["gpu_ids"] == [] and r["gpus"] == [] for r in sd), sd
    assert sum(loads.values()) == 6, f"6 adapters, each loaded once in the whole deployment: {loads}"
    held = [set(r["held"]) for r in sd]
    assert held[0] | held[1] == set(SD_IDS) and not held[0] & held[1], held
    rows = adapters(url)
    for adapter_id in SD_IDS:
        assert rows[adapter_id]["cached"] == "host" and len(rows[adapter_id]["replicas"]) == 1, rows[adapter_id]
    metrics = httpx.get(url + "/metrics").text
    misses = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith('loraswap_replica_adapter_cache_misses_total{model="tiny-sd"'))
    assert misses == 6, "each adapter was read from disk once"
    assert cluster.metric("loraswap_requests_total", '{route="/",status="200"}') == 60


def test_a_busy_replicas_adapter_spreads_to_another_replica(cluster):
    url = cluster.url
    assert generate(url, "hot").status_code == 200
    wait_for(lambda: len(adapters(url)["hot"]["replicas"]) == 1, what="hot held by one replica")
    time.sleep(1.0)  # Serve's routers learn where it is held
    # a burst for one adapter: the least busy replica takes each, so the second one loads it too
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: generate(url, "hot", steps=30, seed=i), range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    assert len(wait_for(lambda: len(r := adapters(url)["hot"]["replicas"]) == 2 and r, what="hot on 2")) == 2


def test_lru_eviction_when_a_replicas_budget_is_full(cluster):
    url = cluster.url

    def state(loads: int) -> dict:
        return wait_for(lambda: (xl := replicas(url, XL)) and xl[0]["loads"] == loads and xl[0], what=f"{loads} loads")

    for adapter_id in XL_IDS:  # budget 2: the third evicts the least recently used (xl/a)
        assert generate(url, adapter_id).status_code == 200
    after = state(3)
    assert after["evictions"] == 1 and set(after["held"]) == {"xl/b", "xl/c"}
    rows = adapters(url)
    assert rows["xl/a"]["cached"] == "disk" and rows["xl/a"]["replicas"] == []
    assert rows["xl/b"]["cached"] == rows["xl/c"]["cached"] == "host"
    assert generate(url, "xl/c").status_code == 200  # now xl/b is the least recently used
    assert generate(url, "xl/a").status_code == 200  # read again, evicting xl/b
    after = state(4)
    assert after["evictions"] == 2 and set(after["held"]) == {"xl/c", "xl/a"}
    rows = adapters(url)
    assert rows["xl/b"]["cached"] == "disk" and rows["xl/a"]["cached"] == "host"
    assert generate(url, "xl/c").status_code == 200
    time.sleep(0.6)
    assert replicas(url, XL)[0]["loads"] == 4, "a held adapter is not loaded again"


def test_base_model_routing_at_the_ingress(cluster):
    url = cluster.url
    refused = generate(url, "flux-only")
    assert refused.status_code == 422
    assert "made for tiny-flux" in refused.json()["error"] and "tiny-sd, tiny-sdxl" in refused.json()["error"]
    mixed = generate(url, "sd/0, xl/a")
    assert mixed.status_code == 422 and "one base model" in mixed.json()["error"]
    served = replicas(url, XL)[0]["served"]
    assert generate(url, "xl/b").status_code == 200  # declares tiny-sdxl: its deployment serves it
    by_name = httpx.post(url + "/models/tiny-sdxl", json={"inputs": "a fox", "parameters": {"num_inference_steps": 2}},
                         timeout=60)
    assert by_name.status_code == 200
    wait_for(lambda: replicas(url, XL)[0]["served"] == served + 2, what="two more images on tiny-sdxl")


def test_a_killed_replica_is_replaced_and_requests_keep_succeeding(cluster):
    url = cluster.url
    before = replicas(url, SD)
    victim = before[0]
    statuses: list[int] = []
    stop = threading.Event()

    def client():
        for i in range(1000):
            if stop.is_set():
                return
            statuses.append(generate(url, SD_IDS[i % 6], seed=i).status_code)
            time.sleep(0.05)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_for(lambda: len(statuses) >= 5, what="requests before the kill")
        # a long request for the victim's adapter goes to the victim; killed under it, it is sent again
        # (when it has reached it by then: tests/unit/test_cluster.py checks the retry itself)
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(generate, url, victim["held"][0], 60, 7)
            time.sleep(0.7)
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = len(statuses)
            assert in_flight.result().status_code == 200, "the request whose replica died is served by another"
        fresh = wait_for(lambda: [r for r in replicas(url, SD) if r["replica"] not in {b["replica"] for b in before}],
                         timeout=150, what="a new replica")
        wait_for(lambda: len(statuses) >= killed_at + 10, what="requests after the replacement")
    finally:
        stop.set()
        thread.join(60)
    assert Counter(statuses) == {200: len(statuses)}, Counter(statuses)
    now = replicas(url, SD, alive=False)
    assert not next(r for r in now if r["replica"] == victim["replica"])["alive"]
    assert len([r for r in now if r["alive"]]) == 2 and fresh[0]["pid"] != victim["pid"]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_finishes_requests_in_flight_and_stops_ray(cluster):
    """Last in the module: it stops the cluster."""
    url = cluster.url
    ray_processes = _descendants(cluster.proc.pid)
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in ray_processes if _running(pid)}
    assert {"raylet", "gcs_server"} <= names, names
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(generate, url, "sd/1", 60)
        time.sleep(0.5)
        cluster.proc.send_signal(signal.SIGTERM)
        assert slow.result().status_code == 200, "the request in flight is finished"
    assert cluster.proc.wait(120) == 0
    wait_for(lambda: not any(_running(pid) for pid in ray_processes), timeout=30, what="Ray processes to exit")
