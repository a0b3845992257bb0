"""`loraswap bench family`: any family's full pipeline through the engine, a LoRA swapped per
request, against the compiled base and against load-and-fuse per request.

One process, one model at a time (the largest families leave room for one copy):
1. the fused engine (compiled on a GPU, as the server runs it), after one untimed request of
   the benchmark's size: rounds that alternate the compiled base (no adapter) and an image
   with a different adapter swapped in, so both see the same machine state; the swap time
   and the graphs compiled during the rounds are recorded;
2. the engine is dropped, and a load-and-fuse engine (diffusers' `load_lora_weights` +
   `fuse_lora` per request, eager) makes the same adapter images.
Per-image (per-video) time is the whole pipeline: text encoders, denoising, decode.
"""

import gc
import logging
import tempfile
from pathlib import Path

import torch

from loraswap.bench.common import environment, print_table, summary, timed, write_results
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.startup.compile import graph_count
from loraswap.progress import tracked

logger = logging.getLogger(__name__)


def run_family_bench(model: str, rank: int = 32, adapters: int = 3, rounds: int = 3, steps: int | None = None,
                     width: int | None = None, height: int | None = None, frames: int | None = None,
                     quantize: str = "none", compile: bool | None = None, load_and_fuse: bool = True,
                     out_dir: Path = Path("bench/results"), workdir: Path | None = None) -> dict:
    from loraswap.bench.common import write_random_adapters

    workdir = Path(workdir or tempfile.mkdtemp(prefix="loraswap-bench-"))
    paths = write_random_adapters(model, [(rank, "all")] * adapters, workdir)
    request = GenerateRequest(prompt="a lighthouse on a cliff at dusk", seed=0, steps=steps, width=width,
                              height=height, frames=frames)
    results = {"model": model, "rank": rank, "rounds": rounds, "quantize": quantize, "env": environment(),
               "request": request.model_dump(exclude={"loras", "image", "mask"}),
               "adapter_MiB": round(paths[0].stat().st_size / 2**20, 1)}
    config = dict(model=model, adapters=workdir, quantize=quantize, compile=compile)
    results["fused"] = _fused_rounds(EngineConfig(**config), request, [p.stem for p in paths], rounds)
    _free()  # the fused engine is gone: its memory goes back before the baseline loads
    if load_and_fuse:
        baseline = EngineConfig(**dict(config, swap_mode="load-and-fuse", quantize="none"))
        results["load-and-fuse"] = _baseline_rounds(baseline, request, [p.stem for p in paths], rounds)
    results["summary"] = _summarise(results)
    _report(results, out_dir)
    return results


def _fused_rounds(config: EngineConfig, request: GenerateRequest, ids: list[str], rounds: int) -> dict:
    _reset_peak()
    engine = Engine(config)
    _image(engine, request, [(ids[-1], 1.0)])  # the request's own shapes compiled (start-up warms the defaults')
    for adapter_id in ids:  # read into the adapter cache, as the server's worker leases them while others generate
        engine.set_adapters([(adapter_id, 1.0)])
    graphs = graph_count()
    rows = []
    for r in tracked(range(rounds), "fused rounds"):
        for variant in ("base", "adapter") if r % 2 == 0 else ("adapter", "base"):
            loras = [(ids[r % len(ids)], 1.0)] if variant == "adapter" else []
            seconds, result = _image(engine, request, loras)
            rows.append({"round": r, "variant": variant, "image_s": seconds, "swap_s": result.swap_seconds})
            logger.info("fused round %d %-7s swap %.1f ms, %.3f s", r, variant, result.swap_seconds * 1e3, seconds)
    return {"rows": rows, "recompiles": graph_count() - graphs, "startup": engine.startup_seconds,
            "peak_GiB": _peak_gib()}


def _baseline_rounds(config: EngineConfig, request: GenerateRequest, ids: list[str], rounds: int) -> dict:
    _reset_peak()
    engine = Engine(config)
    rows = []
    for r in tracked(range(rounds), "load-and-fuse rounds"):
        loras = [(ids[(r + 1) % len(ids)], 1.0)]  # a different adapter each request, as in the fused rounds
        seconds, result = _image(engine, request, loras)
        rows.append({"round": r, "variant": "load-and-fuse", "image_s": seconds, "swap_s": result.swap_seconds})
        logger.info("load-and-fuse round %d: load+fuse %.1f ms, %.3f s", r, result.swap_seconds * 1e3, seconds)
    return {"rows": rows, "peak_GiB": _peak_gib()}


def _image(engine: Engine, request: GenerateRequest, loras: list[tuple[str, float]]):
    """(seconds, result) of one request with `loras`."""
    return timed(lambda: engine.generate(request.with_loras(loras)))


def _summarise(results: dict) -> dict:
    rows = results["fused"]["rows"] + results.get("load-and-fuse", {}).get("rows", [])
    out = {}
    for variant in ("base", "adapter", "load-and-fuse"):
        mine = [r for r in rows if r["variant"] == variant]
        if mine:
            out[variant] = {"image_s": summary([r["image_s"] for r in mine]),
                            "swap_ms": summary([r["swap_s"] * 1e3 for r in mine])}
    base = out["base"]["image_s"]["p50"]
    for variant in out.values():
        variant["vs_compiled_base"] = variant["image_s"]["p50"] / base
    return out


def _report(results: dict, out_dir: Path) -> None:
    s = results["summary"]
    rows = [[v, f"{d['swap_ms']['p50']:.1f}", f"{d['image_s']['p50']:.3f}", f"{d['vs_compiled_base']:.3f}"]
            for v, d in s.items()]
    name = f"family-{results['model']}{'' if results['quantize'] == 'none' else '-' + results['quantize']}"
    title = f"bench family {results['model']} ({results['env'].get('gpu', 'cpu')})"
    results["table"] = print_table(title, ["variant", "swap ms p50", "per image s p50", "vs compiled base"], rows)
    print("recompiles:", results["fused"]["recompiles"], "peak GiB:", results["fused"]["peak_GiB"],
          results.get("load-and-fuse", {}).get("peak_GiB"), flush=True)
    write_results(out_dir, name, results)


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
