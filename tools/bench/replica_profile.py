"""Why one image takes longer in a Ray Serve replica than in the plain server: the same requests
to both, one client, the servers taking turns, with the GPU and the processes watched.

    PYTHONPATH=src python tools/bench/replica_profile.py --model sdxl-random --out $OUT/replica-profile

Starts `loraswap serve` and `loraswap serve --ray --replicas 1` on the model (random adapters
of real size, all read before the passes so each request is swap + generate), then for each
pass (plain and Ray in turn, `--passes` of each) sends `--requests` requests back to back and
records, while they run:
- the GPU's utilisation, SM clock and power every 100 ms (`nvidia-smi`): a GPU starved by
  its host shows utilisation under 100 %;
- which threads of the serving process hold the GIL, and where (`py-spy record --gil
  --threads`, non-blocking): the thread launching the model's kernels should hold it alone;
- the server's own phases (`Server-Timing`: swap, generate).
Writes `summary.json` (per pass: generate p50, GPU utilisation and clock, GIL share by
thread) and each pass's py-spy profile in `--out`.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from loraswap.bench.serve import parse_server_timing, prepare_adapters, start_server, stop_server


class GpuSampler:
    """`nvidia-smi` every 100 ms in the background: utilisation %, SM clock MHz, power W."""

    def __init__(self):
        self.rows: list[tuple[float, float, float]] = []
        self._proc = None
        self._thread = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm,power.draw",
                                           "--format=csv,noheader,nounits", "-lms", "100"],
                                          stdout=subprocess.PIPE, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                self.rows.append(tuple(float(v) for v in line.split(",")[:3]))
            except ValueError:
                pass

    def __exit__(self, *exc):
        if self._proc:
            self._proc.terminate()
            self._proc.wait()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        util, clock, power = zip(*self.rows)
        return {"util_mean": statistics.fmean(util), "util_p10": sorted(util)[len(util) // 10],
                "sm_clock_mean": statistics.fmean(clock), "power_mean": statistics.fmean(power),
                "samples": len(util)}


def gil_profile(pid: int, seconds: float, path: Path) -> subprocess.Popen | None:
    if not shutil.which("py-spy"):
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "200", "--nonblocking", "--threads", "--gil", "--format", "raw",
                             "-o", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def gil_shares(path: Path, seconds: float, rate: int = 200) -> dict:
    """GIL-holding samples per thread (the root frame of each `--threads` stack), as a share
    of the samples taken, and the worker thread's top frames while it holds it."""
    if not path.exists():
        return {}
    threads, tops = Counter(), Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        threads[frames[0]] += int(count)
        tops[";".join(frames[:1] + frames[-2:])] += int(count)
    expected = seconds * rate
    return {"by_thread": {t: round(n / expected, 3) for t, n in threads.most_common(8)},
            "top_frames": [(f, round(n / expected, 3)) for f, n in tops.most_common(15)]}


def replica_pid(url: str) -> int:
    replicas = httpx.get(url + "/replicas", timeout=10).json()["replicas"]
    return next(r["pid"] for r in replicas if r["alive"])


def one_pass(url: str, pid: int, ids: list[str], steps: int, first_seed: int, out: Path, name: str) -> dict:
    phases, latencies = [], []
    with GpuSampler() as gpu, httpx.Client(timeout=600) as http:
        started = time.perf_counter()
        profiler = None
        for i, adapter in enumerate(ids):
            if i == 1:  # after the first request: a whole number of images under the profiler
                profiler = gil_profile(pid, 8, out / f"{name}.gil.txt")
            sent = time.perf_counter()
            response = http.post(url + "/", json={"inputs": f"image {first_seed + i}", "parameters": {
                "num_inference_steps": steps, "seed": first_seed + i}}, headers={"lora": adapter})
            response.raise_for_status()
            latencies.append(time.perf_counter() - sent)
            phases.append(parse_server_timing(response.headers.get("server-timing", "")))
        wall = time.perf_counter() - started
    if profiler:
        _, err = profiler.communicate(timeout=60)
        if profiler.returncode:
            print(f"py-spy on {pid}: {err[-500:]}", file=sys.stderr)
    generate = [p.get("generate", 0.0) for p in phases]
    return {"pass": name, "images_per_s": len(ids) / wall, "latency_p50_s": statistics.median(latencies),
            "generate_p50_ms": statistics.median(generate), "generate_ms": generate,
            "swap_p50_ms": statistics.median(p.get("swap", 0.0) for p in phases), "gpu": gpu.summary(),
            "gil": gil_shares(out / f"{name}.gil.txt", 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sdxl-random")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--server-args", default="", help="extra `loraswap serve` flags for both servers")
    parser.add_argument("--out", type=Path, default=Path("replica-profile"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/loraswap-replica-profile")
    ids = prepare_adapters(args.model.removesuffix("-random"), work / "adapters", args.requests)
    servers, results = {}, {"model": args.model, "steps": args.steps, "server_args": args.server_args, "passes": []}
    try:
        for mode in ("plain", "ray"):
            proc, url, log, _ = start_server(args.model, work / "adapters", "ray" if mode == "ray" else "fused",
                                             args.out / f"server-{mode}.log", args.server_args.split())
            servers[mode] = (proc, url, log, replica_pid(url) if mode == "ray" else proc.pid)
            for adapter in ids:  # every adapter read and the model warm: the passes time swap + generate
                httpx.post(url + "/", json={"inputs": "warm", "parameters": {"num_inference_steps": 2}},
                           headers={"lora": adapter}, timeout=900).raise_for_status()
        for n in range(args.passes):
            for mode in ("plain", "ray"):
                _, url, _, pid = servers[mode]
                result = one_pass(url, pid, ids, args.steps, 1000 * n, args.out, f"{mode}-{n}")
                results["passes"].append(result)
                print(json.dumps({k: v for k, v in result.items() if k not in ("generate_ms", "gil")}), flush=True)
                (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    finally:
        for proc, _, log, *_ in servers.values():
            stop_server(proc)
            log.close()


if __name__ == "__main__":
    main()
