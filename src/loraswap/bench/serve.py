"""`loraswap bench serve`: the HTTP server under a Zipf(1.0) stream over many adapters.

The same stream of requests (adapter ids drawn with p(k) ~ 1/k over `num_ids` ids,
fixed seed) is sent by one client and then by `concurrency` clients to each server:
loraswap (`fused`: fused swap, compiled), the same flags on Ray Serve with one replica
(`ray`), and loraswap in load-and-fuse mode (diffusers `load_lora_weights` + `fuse_lora`
per request, eager). Every server is started first, each in its own process, on the same
model and adapters; then the passes go round the servers in turn, `rounds` times, so a
slow minute of a noisy machine falls on every server alike.

Each response's `x-compute-time` (the server's swap + generation) is kept beside its
latency: the difference is what the HTTP path (and Ray's hops) adds to a request, a
figure the GPU's own noise does not blur.

The ids are hard links to `distinct` real-size random adapter files (mixed ranks and
target sets), so every id is a different adapter to the server (its own cache entry,
its own disk read) without filling the disk.
"""

import ctypes
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from loraswap.bench.common import environment, plot_bars, print_table, summary, write_random_adapters, write_results
from loraswap.engine.parallel.processes import free_port
from loraswap.progress import tracked

logger = logging.getLogger(__name__)

MODES = {  # each server's `loraswap serve` flags
    "fused": ["--swap-mode", "fused"],
    "ray": ["--swap-mode", "fused", "--ray", "--replicas", "1"],
    "load-and-fuse": ["--swap-mode", "load-and-fuse"],
}
LORASWAP_MODES = ("fused", "ray")  # these take the speed options; the baseline runs as diffusers serves it
RAY_ENV = {"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}  # a local cluster of its own; nothing sent out

SPECS = [(4, "attn"), (8, "all"), (16, "attn"), (32, "all"), (64, "all"), (16, "all"), (4, "all"), (8, "attn")]


def zipf_stream(num_ids: int, count: int, seed: int = 0) -> list[int]:
    weights = [1.0 / k for k in range(1, num_ids + 1)]
    return random.Random(seed).choices(range(num_ids), weights=weights, k=count)


def prepare_adapters(architecture: str, root: Path, num_ids: int, specs=SPECS) -> list[str]:
    """`num_ids` ids (`zipf/a00000` ...) over len(specs) real files, and the files."""
    paths = write_random_adapters(architecture, specs, root / "files")
    ids = []
    (root / "zipf").mkdir(exist_ok=True)
    for k in range(num_ids):
        link = root / "zipf" / f"a{k:05d}.safetensors"
        if not link.exists():
            os.link(paths[k % len(paths)], link)
        ids.append(f"zipf/a{k:05d}")
    return ids


def _wait_ready(proc: subprocess.Popen, url: str, name: str, log_path: Path, timeout: float = 900.0) -> None:
    """Until /ready answers 200; raised at once when the server exits or its model failed to load."""
    deadline = time.perf_counter() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log_path.read_text()[-3000:]}")
        try:
            response = httpx.get(url + "/ready", timeout=2)
        except httpx.HTTPError:
            response = None
        if response is not None and response.status_code == 200:
            return
        error = _load_failure(response)
        if error is not None:  # it failed, and will not load
            raise RuntimeError(f"{name} could not load it: {error}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{name} not ready:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def _load_failure(response: httpx.Response | None) -> str | None:
    """The load error a 503 from /ready names; None while the model loads (or from a proxy
    that answers for an application not deployed yet)."""
    if response is None or response.status_code != 503:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if error not in (None, "loading") else None


def start_server(model: str, adapters: Path, mode: str, log_path: Path, extra: list[str]) -> tuple:
    port = free_port()
    log = log_path.open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(RAY_ENV if mode == "ray" else {})}
    proc = subprocess.Popen([sys.executable, "-m", "loraswap", "serve", "--model", model, "--adapters",
                             str(adapters), "--port", str(port), *MODES[mode], "--max-queue", "64", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    try:
        _wait_ready(proc, url, f"{mode} server of {model}", log_path)
    except BaseException:  # not ready (or interrupted): the bench may go on, so stop the server now
        stop_server(proc)
        log.close()
        raise
    logger.info("%s server ready in %.0f s", mode, time.perf_counter() - started)
    return proc, url, log, time.perf_counter() - started


def _die_with_parent() -> None:
    """Run in the server's process before it starts: the kernel sends it SIGTERM when the
    bench dies, however it dies (`timeout`'s SIGTERM or SIGKILL), so no server is left
    holding the GPU behind it (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server: SIGTERM, then SIGKILL if it has not exited after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def send_stream(url: str, stream: list[str], concurrency: int, params: dict, seen: set[str] | None = None) -> dict:
    """Send `stream` with `concurrency` clients: latencies, the server's own compute time of
    each (`x-compute-time`), errors and images/s. `seen`: the adapters this server was asked
    for before (updated); a request is `cold` when its adapter is new to the server, so its
    read (a never-seen file) is on its path."""
    latencies, computes, phases, colds, errors, lock = [], [], [], [], [], threading.Lock()
    position = iter(range(len(stream)))
    seen = set() if seen is None else seen

    def client():
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    i = next(position, None)
                    if i is None:
                        return
                    cold = stream[i] not in seen
                    seen.add(stream[i])
                started = time.perf_counter()
                response = http.post(url + "/", json={"inputs": f"image {i}", "parameters": {**params, "seed": i}},
                                     headers={"lora": stream[i]})
                elapsed = time.perf_counter() - started
                with lock:
                    if response.status_code != 200:
                        errors.append(response.status_code)
                        continue
                    latencies.append(elapsed)
                    colds.append(cold)
                    computes.append(float(response.headers["x-compute-time"]))
                    phases.append(parse_server_timing(response.headers.get("server-timing", "")))

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    # latency - compute: with one client the HTTP path alone (and Ray's hops); with more, the queue too
    overheads = [latency - compute for latency, compute in zip(latencies, computes)]
    return {"concurrency": concurrency, "requests": len(stream), "errors": errors, "wall_s": wall,
            "images_per_s": len(latencies) / wall, "latency_s": summary(latencies),
            "overhead_ms": {k: v * 1e3 if k != "n" else v for k, v in summary(overheads).items()},
            "phases_ms": _phase_summary(phases, latencies), "latencies": latencies, "compute_s": computes,
            "server_timing_ms": phases, "cold": colds}


def _cold_and_cached(runs: list[dict]) -> dict:
    """Over the one-client passes of one server: the p50 latency of the cold requests (the
    first for their adapter: its read on the request's path) and of the others, and the cold
    ones' `read` phase. With more clients a latency holds the queue too, and the adapters are
    no longer new, so those passes would mix unlike things."""
    cold, cached, cold_read = [], [], []
    for run in (r for r in runs if r["concurrency"] == 1):
        for latency, is_cold, timing in zip(run["latencies"], run["cold"], run["server_timing_ms"]):
            (cold if is_cold else cached).append(latency)
            if is_cold and "read" in timing:
                cold_read.append(timing["read"])

    def p50(values):
        return statistics.median(values) if values else None

    return {"cold_requests": len(cold), "cold_p50_s": p50(cold), "cached_p50_s": p50(cached),
            "cold_read_p50_ms": p50(cold_read)}


def parse_server_timing(header: str) -> dict[str, float]:
    """`parse;dur=1.2, swap;dur=3.4` -> {"parse": 1.2, "swap": 3.4} (milliseconds)."""
    phases = {}
    for item in filter(None, (part.strip() for part in header.split(","))):
        name, _, rest = item.partition(";dur=")
        if rest:  # a metric without a duration says nothing here
            phases[name] = float(rest)
    return phases


def _phase_summary(phases: list[dict[str, float]], latencies: list[float]) -> dict[str, dict]:
    """p50 and p99 of each phase the server reported, and of what no phase covers (the HTTP
    server, the network, the client): latency - the phases' sum (the read is within the wait)."""
    names = sorted({name for p in phases for name in p})
    per = {name: summary([p.get(name, 0.0) for p in phases]) for name in names}
    per["unaccounted"] = summary([lat * 1e3 - sum(ms for name, ms in p.items() if name != "read")
                                  for p, lat in zip(phases, latencies)])
    return {name: {"p50": s.get("p50", 0.0), "p99": s.get("p99", 0.0)} for name, s in per.items()}


def _metric(url: str, name: str) -> float:
    """The metric's value, summed over its labels."""
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith((name + " ", name + "{")))


def _server_figures(url: str) -> dict:
    """What the server counted: recompiles, adapter cache, swap time, GPU memory peak (a Ray
    deployment's replicas report theirs)."""
    swaps = _metric(url, "loraswap_adapter_swap_seconds_count")
    peak = _metric(url, "loraswap_gpu_memory_peak_bytes") + _metric(url, "loraswap_replica_gpu_memory_peak_bytes")
    return {"recompiles": _metric(url, "loraswap_recompiles_total"),
            "cache_hits": _metric(url, "loraswap_adapter_cache_hits_total"),
            "cache_misses": _metric(url, "loraswap_adapter_cache_misses_total"),
            "swap_ms_mean": _metric(url, "loraswap_adapter_swap_seconds_sum") / swaps * 1e3 if swaps else 0.0,
            "gpu_peak_GiB": peak / 2**30}


def run_serve_bench(model: str = "sdxl-random", num_ids: int = 2500, requests: int = 24, concurrency: int = 4,
                    steps: int = 25, width: int = 1024, height: int = 1024, workdir: Path | None = None,
                    out_dir: Path = Path("bench/results"), modes: tuple[str, ...] = ("fused", "load-and-fuse"),
                    extra_args: tuple[str, ...] = (), fused_args: tuple[str, ...] = (), rounds: int = 1) -> dict:
    """`extra_args` go to every server; `fused_args` (speed options: `--compile-mode`,
    `--quantize`, `--attention`) to loraswap's own (`fused`, `ray`), the baseline staying as
    diffusers serves it."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    architecture = model.removesuffix("-random")
    workdir = Path(workdir or "/tmp/loraswap-bench-serve")
    ids = prepare_adapters(architecture, workdir / "adapters", num_ids)
    stream = [ids[k] for k in zipf_stream(num_ids, requests)]
    params = {"num_inference_steps": steps, "width": width, "height": height}
    results = {"model": model, "num_ids": num_ids, "requests": requests, "distinct_in_stream": len(set(stream)),
               "params": params, "rounds": rounds, "env": environment(), "fused_args": list(fused_args),
               "modes": {}}
    servers, seen = {}, {mode: set() for mode in modes}
    try:
        # 1. every server up, each warmed by one request outside the figures (first-request effects)
        for mode in modes:
            flags = [*extra_args, *(fused_args if mode in LORASWAP_MODES else ())]
            proc, url, log, ready_s = start_server(model, workdir / "adapters", mode,
                                                    workdir / f"server-{mode}.log", flags)
            servers[mode] = (proc, url, log)
            results["modes"][mode] = {"ready_s": ready_s, "runs": []}
            send_stream(url, [ids[0]], 1, params, seen[mode])
        # 2. the passes, round the servers in turn
        for round_index in tracked(range(rounds), "rounds"):
            for clients in (1, concurrency):
                for mode in modes:
                    run = send_stream(servers[mode][1], stream, clients, params, seen[mode])
                    results["modes"][mode]["runs"].append({"round": round_index, **run})
                    _log_run(mode, run)
                    write_results(out_dir, f"serve-{model}", results)  # a time limit cuts off only this pass
        for mode in modes:
            results["modes"][mode].update(_server_figures(servers[mode][1]))
            results["modes"][mode].update(_cold_and_cached(results["modes"][mode]["runs"]))
            logger.info("%s: cold and cached requests %s", mode, _cold_and_cached(results["modes"][mode]["runs"]))
    finally:
        for proc, _, log in servers.values():
            stop_server(proc)
            log.close()
        write_results(out_dir, f"serve-{model}", results)  # partial results survive a later failure
    _report(results, out_dir)
    return results


def _log_run(mode: str, run: dict) -> None:
    logger.info("%s c=%d: p50 %.2f s p99 %.2f s %.3f img/s, latency - compute p50 %.1f ms, errors %s", mode,
                run["concurrency"], run["latency_s"].get("p50", 0), run["latency_s"].get("p99", 0),
                run["images_per_s"], run["overhead_ms"].get("p50", 0), run["errors"])
    logger.info("%s c=%d phases ms (p50/p99): %s", mode, run["concurrency"],
                ", ".join(f"{k} {v['p50']:.1f}/{v['p99']:.1f}" for k, v in run["phases_ms"].items()))


def _medians(runs: list[dict]) -> dict[int, dict]:
    """Per number of clients, the median over rounds of each pass's p50, p99, images/s and
    latency - compute."""
    by_clients: dict[int, list[dict]] = {}
    for run in runs:
        by_clients.setdefault(run["concurrency"], []).append(run)
    def pick(passes, get):
        return statistics.median(get(p) for p in passes)

    return {clients: {"p50_s": pick(passes, lambda p: p["latency_s"].get("p50", 0)),
                      "p99_s": pick(passes, lambda p: p["latency_s"].get("p99", 0)),
                      "images_per_s": pick(passes, lambda p: p["images_per_s"]),
                      "overhead_p50_ms": pick(passes, lambda p: p["overhead_ms"].get("p50", 0)),
                      "generate_p50_ms": pick(passes, lambda p: p["phases_ms"].get("generate", {}).get("p50", 0))}
            for clients, passes in by_clients.items()}


def _ratios(results: dict) -> None:
    """load-and-fuse against fused, and what Ray adds to the same server (medians over rounds)."""
    medians = {mode: _medians(data["runs"]) for mode, data in results["modes"].items()}
    results["medians"] = {mode: {str(c): m for c, m in per.items()} for mode, per in medians.items()}
    fused, base, ray = medians.get("fused"), medians.get("load-and-fuse"), medians.get("ray")
    if fused and base:
        results["speedup_p50"] = {str(c): base[c]["p50_s"] / fused[c]["p50_s"] for c in fused if c in base}
        results["speedup_throughput"] = {str(c): fused[c]["images_per_s"] / base[c]["images_per_s"]
                                         for c in fused if c in base}
    if fused and ray:
        results["ray_overhead"] = {str(c): {
            "p50_ms": (ray[c]["p50_s"] - fused[c]["p50_s"]) * 1e3,
            "p50_ratio": ray[c]["p50_s"] / fused[c]["p50_s"],
            "throughput_ratio": ray[c]["images_per_s"] / fused[c]["images_per_s"],
            # the replica's own generation against the plain server's: what throughput can reach
            "generate_ratio": ray[c]["generate_p50_ms"] / max(fused[c]["generate_p50_ms"], 1e-9),
            "http_path_ms": ray[c]["overhead_p50_ms"] - fused[c]["overhead_p50_ms"]} for c in fused if c in ray}


def _report(results: dict, out_dir: Path) -> None:
    _ratios(results)
    rows, labels, values = [], [], []
    for mode, per_clients in results["medians"].items():
        data = results["modes"][mode]
        for clients, m in per_clients.items():
            errors = sum(len(r["errors"]) for r in data["runs"] if str(r["concurrency"]) == clients)
            rows.append([mode, clients, f"{m['p50_s']:.3f}", f"{m['p99_s']:.3f}", f"{m['images_per_s']:.3f}",
                         f"{m['overhead_p50_ms']:.1f}", f"{data.get('swap_ms_mean', 0):.1f}", errors,
                         data.get("recompiles", 0)])
            labels.append(f"{mode} c={clients}")
            values.append(m["p50_s"])
    p = results["params"]
    title = (f"bench serve {results['model']} {p['width']}x{p['height']} {p['num_inference_steps']} steps, Zipf(1.0) "
             f"over {results['num_ids']} adapters, {results['requests']} requests, medians of "
             f"{results['rounds']} round(s) ({results['env'].get('gpu', 'cpu')})")
    results["table"] = print_table(title, ["mode", "clients", "p50 s", "p99 s", "images/s", "latency-compute p50 ms",
                                           "swap ms", "errors", "recompiles"], rows)
    for key in ("speedup_p50", "speedup_throughput", "ray_overhead"):
        if key in results:
            print(f"{key}: {results[key]}", flush=True)
    write_results(out_dir, f"serve-{results['model']}", results)
    plot_bars(out_dir / f"serve-{results['model']}.png", title, labels, values, "p50 latency (s)")
