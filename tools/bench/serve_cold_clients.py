"""(CUDA) Whether cold requests slow the requests beside them. One `loraswap serve` (fused);
for each number of clients, a pass over never-seen adapters of `bench serve`'s stream and
the same pass again, cached. Prints each pass's latency and its Server-Timing phases.

    PYTHONPATH=src python tools/bench/serve_cold_clients.py --out serve-cold-two-clients.json
    PYTHONPATH=src python tools/bench/serve_cold_clients.py --clients 2 --fused-args "--compile-mode reduce-overhead"
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from loraswap.bench.serve import prepare_adapters, send_stream, start_server, stop_server

NUM_IDS = 2500


def _passes(ids: list[str], requests: int, clients: list[int]) -> list[tuple[str, list[str], int]]:
    # ids from the Zipf range's tail (none met before; every file among them), each client
    # count's ids apart from the others'
    start, passes = len(ids) - 100, []
    for k, count in enumerate(clients):
        stream = ids[start + k * (requests + 6):start + k * (requests + 6) + requests]
        passes += [(f"cold, {_clients(count)}", stream, count), (f"cached, {_clients(count)}", stream, count)]
    return passes


def _clients(count: int) -> str:
    return f"{count} client" + ("s" if count > 1 else "")


def _line(name: str, run: dict) -> str:
    timings = run["server_timing_ms"]

    def phase(key):
        values = [t.get(key, 0.0) for t in timings]
        return f"{key} p50 {statistics.median(values):.1f} max {max(values):.1f}"

    latency = run["latency_s"]
    return (f"{name}: latency p50 {latency['p50'] * 1e3:.0f} ms max {latency['max'] * 1e3:.0f}; "
            f"{phase('generate')}; {phase('read')}; {phase('swap')}; errors {run['errors']}")


def _serve_passes(args, ids: list[str]) -> dict:
    params = {"num_inference_steps": args.steps, "width": 1024, "height": 1024}
    proc, url, log, _ = start_server(args.model, args.workdir / "adapters", "fused", args.workdir / "server.log",
                                     args.fused_args.split())
    results, seen = {}, set()
    try:
        send_stream(url, [ids[0]], 1, params, seen)  # first-request effects outside the figures
        for name, stream, clients in _passes(ids, args.requests, args.clients):
            results[name] = send_stream(url, stream, clients, params, seen)
            print(_line(name, results[name]), flush=True)
    finally:
        stop_server(proc)
        log.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux-dev-random")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[2, 1])
    parser.add_argument("--fused-args", default="", help="the server's speed options, as one string")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/loraswap-cold-clients"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = prepare_adapters(args.model.removesuffix("-random"), args.workdir / "adapters", NUM_IDS)
    results = _serve_passes(args, ids)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
