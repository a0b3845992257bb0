"""`loraswap bench serve`: the HTTP server under a Zipf(1.0) stream over many adapters.

The same stream of requests (adapter ids drawn with p(k) ~ 1/k over `num_ids` ids,
fixed seed) is sent by one client and then by `concurrency` clients to a loraswap
server (fused swap, compiled) and to the same server in load-and-fuse mode (diffusers
`load_lora_weights` + `fuse_lora` per request, eager). Each server runs in its own
process, one after the other, on the same model and adapters.

The ids are hard links to `distinct` real-size random adapter files (mixed ranks and
target sets), so every id is a different adapter to the server (its own cache entry,
its own disk read) without filling the disk.
"""

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from .common import environment, plot_bars, print_table, summary, write_random_adapters, write_results

logger = logging.getLogger(__name__)

SPECS = [(4, "attn"), (8, "all"), (16, "attn"), (32, "all"), (64, "all"), (16, "all"), (4, "all"), (8, "attn")]


def zipf_stream(num_ids: int, count: int, seed: int = 0) -> list[int]:
    weights = [1.0 / k for k in range(1, num_ids + 1)]
    return random.Random(seed).choices(range(num_ids), weights=weights, k=count)


def prepare_adapters(shape: str, root: Path, num_ids: int, specs=SPECS) -> list[str]:
    """`num_ids` ids (`zipf/a00000` ...) over len(specs) real files, and the files."""
    paths = write_random_adapters(shape, specs, root / "files")
    ids = []
    (root / "zipf").mkdir(exist_ok=True)
    for k in range(num_ids):
        link = root / "zipf" / f"a{k:05d}.safetensors"
        if not link.exists():
            os.link(paths[k % len(paths)], link)
        ids.append(f"zipf/a{k:05d}")
    return ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, adapters: Path, mode: str, log_path: Path, extra: list[str]) -> tuple:
    port = _free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "loraswap", "serve", "--model", model, "--adapters", str(adapters),
                             "--port", str(port), "--swap-mode", mode, "--max-queue", "64", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{mode} server exited:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > 900:
                raise TimeoutError(f"{mode} server not ready:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
    except BaseException:  # not ready (or interrupted): the bench may go on, so stop the server now
        _stop(proc)
        log.close()
        raise
    logger.info("%s server ready in %.0f s", mode, time.perf_counter() - started)
    return proc, url, log, time.perf_counter() - started


def _die_with_parent() -> None:
    """Run in the server's process before it starts: the kernel sends it SIGTERM when the
    bench dies, however it dies (`timeout`'s SIGTERM or SIGKILL), so no server is left
    holding the GPU behind it (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    """Stop a server: SIGTERM, then SIGKILL if it has not exited after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drive(url: str, stream: list[str], concurrency: int, params: dict) -> dict:
    """Send `stream` with `concurrency` clients; latencies, errors and images/s."""
    latencies, errors, lock = [], [], threading.Lock()
    position = iter(range(len(stream)))

    def client():
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    i = next(position, None)
                if i is None:
                    return
                started = time.perf_counter()
                response = http.post(url + "/", json={"inputs": f"image {i}", "parameters": {**params, "seed": i}},
                                     headers={"lora": stream[i]})
                elapsed = time.perf_counter() - started
                with lock:
                    (latencies if response.status_code == 200 else errors).append(
                        elapsed if response.status_code == 200 else response.status_code)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": len(stream), "errors": errors, "wall_s": wall,
            "images_per_s": len(latencies) / wall, "latency_s": summary(latencies), "latencies": latencies}


def _metric(url: str, name: str) -> float:
    """The metric's value, summed over its labels."""
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith((name + " ", name + "{")))


def run_serve_bench(model: str = "sdxl-random", num_ids: int = 2500, requests: int = 24, concurrency: int = 4,
                    steps: int = 25, width: int = 1024, height: int = 1024, workdir: Path | None = None,
                    out_dir: Path = Path("bench/results"), modes: tuple[str, ...] = ("fused", "load-and-fuse"),
                    extra_args: tuple[str, ...] = (), fused_args: tuple[str, ...] = ()) -> dict:
    """`extra_args` go to both servers; `fused_args` (speed options: `--compile-mode`,
    `--quantize`, `--attention`) to loraswap's alone, the baseline staying as diffusers serves it."""
    shape = model.removesuffix("-random")
    workdir = Path(workdir or "/tmp/loraswap-bench-serve")
    ids = prepare_adapters(shape, workdir / "adapters", num_ids)
    stream = [ids[k] for k in zipf_stream(num_ids, requests)]
    params = {"num_inference_steps": steps, "width": width, "height": height}
    results = {"model": model, "num_ids": num_ids, "requests": requests, "distinct_in_stream": len(set(stream)),
               "params": params, "env": environment(), "fused_args": list(fused_args), "modes": {}}
    for mode in modes:
        proc, url, log, ready_s = _start_server(model, workdir / "adapters", mode, workdir / f"server-{mode}.log",
                                                [*extra_args, *(fused_args if mode == "fused" else ())])
        try:
            _drive(url, [ids[0]], 1, params)  # one request outside the figures (first-request effects)
            runs = []
            results["modes"][mode] = {"ready_s": ready_s, "runs": runs}
            for clients in (1, concurrency):
                runs.append(_drive(url, stream, clients, params))
                write_results(out_dir, f"serve-{model}", results)  # a time limit cuts off only the pass it hits
            results["modes"][mode].update(recompiles=_metric(url, "loraswap_recompiles_total"),
                                          cache_hits=_metric(url, "loraswap_adapter_cache_hits_total"),
                                          cache_misses=_metric(url, "loraswap_adapter_cache_misses_total"),
                                          gpu_peak_GiB=_metric(url, "loraswap_gpu_memory_peak_bytes") / 2**30)
            for run in runs:
                logger.info("%s c=%d: p50 %.2f s p99 %.2f s %.3f img/s errors %s", mode, run["concurrency"],
                            run["latency_s"].get("p50", 0), run["latency_s"].get("p99", 0), run["images_per_s"],
                            run["errors"])
        finally:
            _stop(proc)
            log.close()
        write_results(out_dir, f"serve-{model}", results)  # partial results survive a later failure
    _report(results, out_dir)
    return results


def _report(results: dict, out_dir: Path) -> None:
    rows, labels, values = [], [], []
    for mode, data in results["modes"].items():
        for run in data["runs"]:
            lat = run["latency_s"]
            rows.append([mode, run["concurrency"], f"{lat.get('p50', 0):.2f}", f"{lat.get('p99', 0):.2f}",
                         f"{run['images_per_s']:.3f}", len(run["errors"]), data.get("recompiles", 0)])
            labels.append(f"{mode} c={run['concurrency']}")
            values.append(lat.get("p50", 0))
    fused, base = results["modes"].get("fused"), results["modes"].get("load-and-fuse")
    if fused and base:
        results["speedup_p50"] = {str(f["concurrency"]): b["latency_s"]["p50"] / f["latency_s"]["p50"]
                                  for f, b in zip(fused["runs"], base["runs"])}
        results["speedup_throughput"] = {str(f["concurrency"]): f["images_per_s"] / b["images_per_s"]
                                         for f, b in zip(fused["runs"], base["runs"])}
    p = results["params"]
    title = (f"bench serve {results['model']} {p['width']}x{p['height']} {p['num_inference_steps']} steps, Zipf(1.0) "
             f"over {results['num_ids']} adapters, {results['requests']} requests "
             f"({results['env'].get('gpu', 'cpu')})")
    results["table"] = print_table(title, ["mode", "clients", "p50 s", "p99 s", "images/s", "errors", "recompiles"],
                                   rows)
    if "speedup_p50" in results:
        print("p50 latency, load-and-fuse / fused:", results["speedup_p50"], "throughput ratio:",
              results["speedup_throughput"], flush=True)
    write_results(out_dir, f"serve-{results['model']}", results)
    plot_bars(out_dir / f"serve-{results['model']}.png", title, labels, values, "p50 latency (s)")
