"""Whether making an adapter's host copy on a background thread slows the GPU worker: the
worker launches a swap's worth of small kernels and waits for them, again and again until
another thread has copied 428 MiB (a FLUX.1 rank-64 LoRA) from the GPU, on a side stream
as the cache does, into host memory made each way the cache could make it. Prints, per
way, the median and the worst of the worker's iterations and the background copy's time.
On a GPU machine:

    PYTHONPATH=src python scripts/pinning_stall_probe.py [--rounds 5] [--registered] [--out F]

`--registered` first sets what the server sets (`engine/startup.py:pin_by_registering`): torch
pins by registering malloc'd pages rather than by `cudaHostAlloc`.
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from loraswap.adapters.host_memory import host_bytes
from loraswap.engine.startup import pin_by_registering

NBYTES = 428 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--registered", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.registered:
        pin_by_registering()
    source = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    matrix = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    kept = []

    def worker() -> float:  # 300 launches, then a wait: about a FLUX.1 swap's pattern
        started = time.perf_counter()
        for _ in range(300):
            matrix @ matrix[:64].T
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    def new_pinned():  # a new block each time, kept (as the cache keeps each adapter's copy)
        with torch.cuda.stream(side):
            kept.append(torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True).copy_(source))

    def pageable():
        with torch.cuda.stream(side):
            host_bytes(NBYTES).copy_(source)

    ways = {"nothing": None, "pinned, a new block": new_pinned, "pageable, huge pages": pageable}
    for _ in range(3):
        worker()
    times: dict[str, list[float]] = {name: [] for name in ways}
    background: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            times[name] += _beside(way, worker, background[name])
    figures = {name: {"worker_ms_median": statistics.median(times[name]), "worker_ms_worst": max(times[name]),
                      "copy_ms_median": statistics.median(background[name]) if background[name] else None}
               for name in ways}
    print(f"registered pinning: {args.registered}; worker ms median (worst), background copy ms median")
    for name, f in figures.items():
        copy = f"{f['copy_ms_median']:7.1f}" if f["copy_ms_median"] is not None else "      -"
        print(f"  {name:24s} {f['worker_ms_median']:7.1f} ({f['worker_ms_worst']:7.1f})  {copy}")
    if args.out:
        args.out.write_text(json.dumps({"registered": args.registered, "device": torch.cuda.get_device_name(),
                                        "rounds": args.rounds, "ways": figures}, indent=1))


def _beside(way, worker, background: list[float]) -> list[float]:
    """The worker's iterations while `way` runs on another thread (three alone for nothing)."""
    if way is None:
        return [worker() for _ in range(3)]
    done = threading.Event()

    def run():
        started = time.perf_counter()
        way()
        background.append((time.perf_counter() - started) * 1e3)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    times = [worker()]
    while not done.is_set():
        times.append(worker())
    thread.join()
    return times


if __name__ == "__main__":
    main()
