"""(CUDA) Whether cold requests slow the requests beside them. For each variant, one
`loraswap serve` (fused); for each number of clients, a pass over never-seen adapters of
`bench serve`'s stream and the same pass again, cached. Prints each pass's latency and its
Server-Timing phases.

    PYTHONPATH=src python tools/bench/serve_cold_clients.py --out serve-cold-two-clients.json
    PYTHONPATH=src python tools/bench/serve_cold_clients.py --clients 2 \\
        --variant as-is --variant copy-down-pageable --variant host-read --variant host-read-unpinned

The variants change the server's cold path to tell what slows the generation beside it:
`copy-down-pageable` copies an adapter read to the GPU down to pageable RAM (no pinning);
`host-read` packs never-seen adapters on the host, as before they were read to the GPU;
`host-read-unpinned` does that and pins nothing.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from loraswap.bench.serve import _drive, prepare_adapters, start_server, stop_server

NUM_IDS = 2500
VARIANT_ENV = "LORASWAP_COLD_VARIANT"
VARIANTS = ("as-is", "copy-down-pageable", "host-read", "host-read-unpinned")


def apply_variant() -> None:
    """In the server's process (through the sitecustomize `_variant_site` writes): patch the
    adapter cache as the variant named in the environment says."""
    from loraswap.adapters import cache

    variant = os.environ.get(VARIANT_ENV, "as-is")
    if variant.startswith("host-read"):
        cache.AdapterCache.start_gpu_read = lambda self, nbytes: False
    if variant == "copy-down-pageable":
        def copy_down(self, ref):
            entry = ref()
            if entry is not None and self.holds(entry) and entry.host.device.type != "cpu":
                self._copy_down_or_drop(entry)
        cache.AdapterCache._pin_later = copy_down
    if variant == "host-read-unpinned":
        cache.AdapterCache._pin_later = lambda self, ref: None


def _variant_site(folder: Path) -> str:
    """A folder whose sitecustomize applies the variant in every Python process started
    with it on PYTHONPATH (the server is a subprocess)."""
    (folder / "sitecustomize.py").write_text(
        f"import os, sys\nif os.environ.get({VARIANT_ENV!r}):\n"
        f"    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "    import serve_cold_clients\n    serve_cold_clients.apply_variant()\n")
    return str(folder)


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


def _serve_passes(args, ids: list[str], variant: str, index: int) -> dict:
    os.environ[VARIANT_ENV] = variant
    params = {"num_inference_steps": args.steps, "width": 1024, "height": 1024}
    proc, url, log, _ = start_server(args.model, args.workdir / "adapters", "fused",
                                     args.workdir / f"server-{index}-{variant}.log", args.fused_args.split())
    results, seen = {}, set()
    try:
        _drive(url, [ids[0]], 1, params, seen)  # first-request effects outside the figures
        for name, stream, clients in _passes(ids, args.requests, args.clients):
            results[name] = _drive(url, stream, clients, params, seen)
            print(f"{variant}, {_line(name, results[name])}", flush=True)
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
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeatable; default as-is")
    parser.add_argument("--fused-args", default="", help="the server's speed options, as one string")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/loraswap-cold-clients"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = prepare_adapters(args.model.removesuffix("-random"), args.workdir / "adapters", NUM_IDS)
    site = _variant_site(Path(tempfile.mkdtemp(prefix="cold-variant-site-")))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    results = {}
    for index, variant in enumerate(args.variant or ["as-is"]):
        results[f"{index} {variant}"] = _serve_passes(args, ids, variant, index)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
