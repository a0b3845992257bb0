"""Where a server's start-up goes: one engine built under cProfile, on a compile cache.

Run it twice on one folder (cold, then warm) to see what a restart still pays for:

    python tools/bench/startup_profile.py --model flux-dev-random --quantize fp8 --compile-cache /tmp/cc --out cold.txt
    python tools/bench/startup_profile.py --model flux-dev-random --quantize fp8 --compile-cache /tmp/cc --out warm.txt

--from-disk DIR saves the model to DIR first (once) and serves it from there, so that the
load is a real `from_pretrained` of safetensors files; --images N then times N full images;
--drop-page-cache evicts its files from the page cache first (a load from the disk, not
from RAM); --loras N swaps a real-size random adapter before each image; --quantize-text-encoders,
--pristine, --max-gpu-memory-gb and --gpu-cache-mb give the 24 GB mode (peak GPU memory
is reported). --inductor-tuning restores torchao's process-wide Inductor settings (coordinate-descent
tuning), which loraswap's quantization no longer applies, for comparison.

Writes the engine's start-up figures, torch.compile's own phase timings and the
functions that took the most time (cumulative and own) to --out (the whole profile beside
it, as OUT.prof), and prints the first two.
"""

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

from loraswap.adapters.cache import CacheConfig
from loraswap.bench.serve import prepare_adapters
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.models import load_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux-dev-random")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--compile-cache", type=Path, required=True)
    parser.add_argument("--no-profile", action="store_true", help="time only (cProfile slows tracing)")
    parser.add_argument("--from-disk", type=Path, help="save the model here once, then load it from here")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="with --from-disk: evict the model's files from the page cache first (a restart on a "
                             "host that has not read them lately)")
    parser.add_argument("--images", type=int, default=0, help="full images timed after start-up")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--quantize-text-encoders", default="none")
    parser.add_argument("--pristine", default="device")
    parser.add_argument("--max-gpu-memory-gb", type=float)
    parser.add_argument("--gpu-cache-mb", type=float, default=None)
    parser.add_argument("--loras", type=int, default=0,
                        help="real-size random adapters (bench serve's set); each image swaps to the next")
    parser.add_argument("--adapters-dir", type=Path, default=Path("/tmp/loraswap-profile-adapters"))
    parser.add_argument("--no-compile-vae", action="store_true", help="leave the VAE decoder eager")
    parser.add_argument("--compile-while-loading", action="store_true",
                        help="with --from-disk: build, then compile a stand-in while the weights are copied in")
    parser.add_argument("--inductor-tuning", action="store_true", help="torchao's Inductor settings")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model, saved_s = args.model, None
    if args.from_disk:
        model, saved_s = str(args.from_disk), save_once(args.model, args.from_disk)
        if args.drop_page_cache:
            print(f"evicted {drop_page_cache(args.from_disk) / 2**30:.1f} GiB of files from the page cache")
    if args.inductor_tuning:
        from torchao.quantization.utils import recommended_inductor_config_setter

        recommended_inductor_config_setter()
    adapters = ids = None
    if args.loras:
        adapters = args.adapters_dir
        ids = prepare_adapters(args.model.removesuffix("-random"), adapters, args.loras)
    cache = CacheConfig() if args.gpu_cache_mb is None else CacheConfig(gpu_bytes=int(args.gpu_cache_mb * 2**20))
    config = EngineConfig(model=model, quantize=args.quantize, compile=True, compile_mode=args.compile_mode,
                          compile_cache=args.compile_cache, quantize_text_encoders=args.quantize_text_encoders,
                          pristine=args.pristine, max_gpu_memory_gb=args.max_gpu_memory_gb, adapters=adapters,
                          cache=cache, compile_vae=False if args.no_compile_vae else None,
                          compile_while_loading=args.compile_while_loading)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # not the bf16 pipeline `--from-disk` saved
    profile = None if args.no_profile else cProfile.Profile()
    started = time.perf_counter()
    if profile:
        profile.enable()
    engine = Engine(config)
    if profile:
        profile.disable()
    total = time.perf_counter() - started
    report = io.StringIO()
    figures = {"total_s": round(total, 2), **{k: round(v, 2) for k, v in engine.startup_seconds.items()},
               "lookups": engine.compile_cache_lookups, "torch": torch.__version__, "saved_s": saved_s}
    if args.images:
        results = [engine.generate(GenerateRequest(prompt="a lighthouse at dusk", seed=i, steps=args.steps,
                                                   loras=[(ids[i % len(ids)], 1.0)] if ids else []))
                   for i in range(args.images)]
        figures["image_s"] = [round(r.generate_seconds, 3) for r in results]
        figures["image_s_median"] = round(statistics.median(r.generate_seconds for r in results), 3)
        figures["swap_ms"] = [round(r.swap_seconds * 1e3, 1) for r in results]
    if torch.cuda.is_available():
        figures["gpu_peak_allocated_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        figures["gpu_peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    report.write(json.dumps(figures) + "\n\n")
    report.write(torch._dynamo.utils.compile_times(repr="str", aggregate=True) + "\n\n")
    print(report.getvalue(), flush=True)
    if profile:
        profile.dump_stats(args.out.with_suffix(".prof"))  # for pstats' callers and callees
        for key in ("cumulative", "tottime"):
            stats = pstats.Stats(profile, stream=report)
            stats.sort_stats(key).print_stats(70)
    args.out.write_text(report.getvalue())


def drop_page_cache(folder: Path) -> int:
    """Ask the kernel to drop the folder's files from the page cache (posix_fadvise
    DONTNEED: clean pages go, so the next read comes from the disk); bytes covered."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += path.stat().st_size
            finally:
                os.close(fd)
    return total


def save_once(model: str, folder: Path) -> float | None:
    """Save `model` (built as loraswap builds it) to `folder` unless it is there; seconds taken."""
    if (folder / "model_index.json").exists():
        return None
    started = time.perf_counter()
    pipeline = load_pipeline(model, device="cuda" if torch.cuda.is_available() else "cpu")
    pipeline.save_pretrained(folder, safe_serialization=True)
    del pipeline
    torch.cuda.empty_cache()
    return round(time.perf_counter() - started, 1)


if __name__ == "__main__":
    main()
