"""Whether making an adapter's host copy on a background thread slows the GPU worker: the
worker launches a swap's worth of small kernels and waits for them, while another thread
copies 428 MiB (a FLUX.1 rank-64 LoRA) from the GPU into host memory made each way the
cache could make it. Prints the median of the worker's milliseconds, its worst, and the
background copy's time, per way. On a GPU machine:

    PYTHONPATH=src python scripts/pinning_stall_probe.py [--rounds 5] [--registered]

`--registered` first sets what the server sets (`host_memory.pin_by_registering`): torch
pins by registering malloc'd pages rather than by `cudaHostAlloc`.
"""

import argparse
import statistics
import threading
import time

import torch

from loraswap.adapters.host_memory import host_bytes, pin_by_registering

NBYTES = 428 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--registered", action="store_true")
    args = parser.parse_args()
    if args.registered:
        pin_by_registering()
    source = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    matrix = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kept = []

    def worker() -> float:  # 300 launches, then a wait: about a FLUX.1 swap's pattern
        started = time.perf_counter()
        for _ in range(300):
            matrix @ matrix[:64].T
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3

    def new_pinned():  # a new block each time, kept (as the cache keeps each adapter's copy)
        kept.append(torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True).copy_(source))

    def pageable():
        host_bytes(NBYTES).copy_(source)

    ways = {"nothing": None, "pinned, a new block": new_pinned, "pageable, huge pages": pageable}
    for _ in range(3):
        worker()
    times: dict[str, list[float]] = {name: [] for name in ways}
    background: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            thread = None
            if way is not None:
                def run(way=way, name=name):
                    started = time.perf_counter()
                    way()
                    background[name].append((time.perf_counter() - started) * 1e3)
                thread = threading.Thread(target=run)
                thread.start()
                time.sleep(0.002)
            times[name].append(worker())
            if thread is not None:
                thread.join()
    print(f"registered pinning: {args.registered}; worker ms median (worst), background copy ms median")
    for name in ways:
        copy = f"{statistics.median(background[name]):7.1f}" if background[name] else "      -"
        print(f"  {name:24s} {statistics.median(times[name]):7.1f} ({max(times[name]):7.1f})  {copy}")


if __name__ == "__main__":
    main()
