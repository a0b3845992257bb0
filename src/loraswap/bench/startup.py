"""`loraswap bench startup`: time to the first image after a restart, cold and with the compile cache.

Each round starts `loraswap serve --compile --compile-cache DIR` twice, each time in a
fresh process, on one new, empty DIR: `cold` compiles everything and fills DIR; `warm`
is a restart that compiles from it. Of each start it records, from the server's
/metrics: the engine's load time (pipeline on the device), its compile + warm-up time
and its time to the first image (the 2-step warm-up image, from the engine's start;
`loraswap_startup_seconds`), torch's cache lookups (`loraswap_compile_cache_lookups`) and
graphs compiled after warm-up; and, from outside, the process's time to /ready (Python
imports included), the latency of a first request and the size of DIR. The target is a
warm first image within 1.5x the load time.
"""

import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraswap.bench.common import environment, plot_bars, print_table, write_results
from loraswap.bench.serve import start_server
from loraswap.progress import tracked

logger = logging.getLogger(__name__)

STARTS = ("cold", "warm")


def run_startup_bench(model: str = "sdxl-random", compile_cache: Path | None = None, rounds: int = 1,
                      steps: int = 2, device: str = "auto", serve_args: str = "",
                      out_dir: Path = Path("bench/results"), workdir: Path | None = None) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /ready poll
    workdir = Path(workdir or "/tmp/loraswap-bench-startup")
    (workdir / "adapters").mkdir(parents=True, exist_ok=True)
    root = _empty_cache_root(compile_cache, workdir)
    extra = ["--compile", "--device", device, *shlex.split(serve_args)]
    results = {"model": model, "device": device, "rounds": rounds, "steps": steps, "serve_args": serve_args,
               "compile_cache": str(root), "env": environment(), "runs": []}
    name = f"startup-{model}"
    for round_ in tracked(range(rounds), "rounds"):
        cache_dir = root / f"round-{round_}"
        for start in STARTS:  # cold then warm on the same folder: the warm start is the restart
            run = _start_once(model, workdir, cache_dir, extra, steps, workdir / f"server-{round_}-{start}.log")
            results["runs"].append({"round": round_, "start": start, **run})
            logger.info("round %d %s: load %.1f s, first image %.1f s (%.2fx load), lookups %s", round_, start,
                        run["load_s"], run["first_image_s"], run["first_image_over_load"], run["lookups"])
            write_results(out_dir, name, results)  # partial results survive a later failure
    _summarise(results)
    _report(results, out_dir, name)
    return results


def _empty_cache_root(compile_cache: Path | None, workdir: Path) -> Path:
    """The folder the rounds' caches go under: the one given (it must be empty, for the cold
    starts), or a new one under `workdir`."""
    if compile_cache is None:
        return Path(tempfile.mkdtemp(prefix="compile-cache-", dir=workdir))
    if compile_cache.exists() and (not compile_cache.is_dir() or any(compile_cache.iterdir())):
        raise ValueError(f"--compile-cache {compile_cache} is not an empty folder: the cold start needs an empty "
                         "cache; remove it or give a new folder")
    compile_cache.mkdir(parents=True, exist_ok=True)
    return compile_cache


def _start_once(model: str, workdir: Path, cache_dir: Path, extra: list[str], steps: int, log_path: Path) -> dict:
    proc, url, log, ready_s = start_server(model, workdir / "adapters", "fused", log_path,
                                            [*extra, "--compile-cache", str(cache_dir)])
    try:
        started = time.perf_counter()
        response = httpx.post(url + "/", json={"inputs": "a lighthouse at dusk",
                                               "parameters": {"num_inference_steps": steps, "seed": 0}},
                              timeout=900)
        first_request_s = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"first request answered {response.status_code}: {response.text[:500]}")
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    phases = {s.labels["phase"]: s.value for s in families["loraswap_startup_seconds"].samples}
    lookups: dict[str, dict[str, int]] = {}
    for s in families["loraswap_compile_cache_lookups"].samples:
        lookups.setdefault(s.labels["cache"], {})[s.labels["result"]] = int(s.value)
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    return {"load_s": phases["load"], "warmup_s": phases["warmup"], "first_image_s": phases["first_image"],
            "first_image_over_load": phases["first_image"] / phases["load"], "ready_s": ready_s,
            "first_request_s": first_request_s, "lookups": lookups,
            "recompiles": sum(s.value for s in families["loraswap_recompiles"].samples
                              if s.name == "loraswap_recompiles_total"),
            "cache_files": len(files), "cache_bytes": sum(p.stat().st_size for p in files)}


def _summarise(results: dict) -> None:
    summary = {}
    for start in STARTS:
        runs = [r for r in results["runs"] if r["start"] == start]
        summary[start] = {key: statistics.median([r[key] for r in runs])
                          for key in ("load_s", "warmup_s", "first_image_s", "first_image_over_load", "ready_s",
                                      "first_request_s")}
    summary["first_image_speedup"] = summary["cold"]["first_image_s"] / summary["warm"]["first_image_s"]
    summary["warm_within_1_5x_load"] = summary["warm"]["first_image_over_load"] <= 1.5
    results["summary"] = summary


def _report(results: dict, out_dir: Path, name: str) -> None:
    rows = []
    for run in results["runs"]:
        fx, aot = run["lookups"].get("fxgraph", {}), run["lookups"].get("aotautograd", {})
        rows.append([run["round"], run["start"], f"{run['load_s']:.2f}", f"{run['warmup_s']:.2f}",
                     f"{run['first_image_s']:.2f}", f"{run['first_image_over_load']:.2f}", f"{run['ready_s']:.1f}",
                     f"{run['first_request_s']:.2f}",
                     f"{fx.get('hit', 0)}/{fx.get('miss', 0)}/{fx.get('bypass', 0)}",
                     f"{aot.get('hit', 0)}/{aot.get('miss', 0)}/{aot.get('bypass', 0)}", int(run["recompiles"]),
                     f"{run['cache_bytes'] / 2**20:.1f}"])
    where = results["env"].get("gpu", "cpu")
    title = f"bench startup {results['model']} ({where}), {results['rounds']} round(s), cold then warm per round"
    results["table"] = print_table(title, ["round", "start", "load s", "compile+warm-up s", "first image s",
                                           "first image / load", "process ready s", "first request s",
                                           "fxgraph hit/miss/bypass", "aotautograd hit/miss/bypass",
                                           "recompiles", "cache MiB"], rows)
    s = results["summary"]
    print(f"median first image: cold {s['cold']['first_image_s']:.2f} s, warm {s['warm']['first_image_s']:.2f} s "
          f"({s['first_image_speedup']:.2f}x faster); warm first image / load {s['warm']['first_image_over_load']:.2f}"
          f" (target <= 1.5: {'met' if s['warm_within_1_5x_load'] else 'not met'})", flush=True)
    write_results(out_dir, name, results)
    plot_bars(out_dir / f"{name}.png", title, ["load", "first image cold", "first image warm"],
              [s["warm"]["load_s"], s["cold"]["first_image_s"], s["warm"]["first_image_s"]], "seconds (median)")
