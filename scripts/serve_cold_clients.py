"""(CUDA) Whether cold requests slow the requests beside them: one `loraswap serve` (fused),
four passes over never-seen adapters of `bench serve`'s stream, each pass then again cached,
with two clients and with one. Prints each pass's latency and Server-Timing phases.

    PYTHONPATH=src python scripts/serve_cold_clients.py --out serve-cold-two-clients.json
"""

import argparse
import json
import statistics
from pathlib import Path

from loraswap.bench.serve import _drive, prepare_adapters, start_server, stop_server

NUM_IDS = 2500


def _passes(ids: list[str], requests: int) -> list[tuple[str, list[str], int]]:
    # ids from the Zipf range's tail (none met before; every file among them), the two
    # passes' ids apart
    start = len(ids) - 100
    two, one = ids[start:start + requests], ids[start + requests + 6:start + 2 * requests + 6]
    return [("cold, 2 clients", two, 2), ("cached, 2 clients", two, 2),
            ("cold, 1 client", one, 1), ("cached, 1 client", one, 1)]


def _line(name: str, run: dict) -> str:
    timings = run["server_timing_ms"]

    def phase(key):
        values = [t.get(key, 0.0) for t in timings]
        return f"{key} p50 {statistics.median(values):.1f} max {max(values):.1f}"

    latency = run["latency_s"]
    return (f"{name}: latency p50 {latency['p50'] * 1e3:.0f} ms max {latency['max'] * 1e3:.0f}; "
            f"{phase('generate')}; {phase('read')}; {phase('swap')}; errors {run['errors']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux-dev-random")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/loraswap-cold-clients"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = prepare_adapters(args.model.removesuffix("-random"), args.workdir / "adapters", NUM_IDS)
    params = {"num_inference_steps": args.steps, "width": 1024, "height": 1024}
    proc, url, log, _ = start_server(args.model, args.workdir / "adapters", "fused",
                                     args.workdir / "server.log", [])
    results, seen = {}, set()
    try:
        _drive(url, [ids[0]], 1, params, seen)  # first-request effects outside the figures
        for name, stream, clients in _passes(ids, args.requests):
            results[name] = _drive(url, stream, clients, params, seen)
            print(_line(name, results[name]), flush=True)
    finally:
        stop_server(proc)
        log.close()
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
