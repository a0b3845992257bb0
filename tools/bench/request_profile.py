"""Where one request's time goes: adapter read, swap, text encoders, denoiser, VAE, image encoding.

Builds one engine, then makes images one at a time, each with an adapter it has not read
yet (bench serve's real-size random set: the cold path a stream of many adapters takes),
then the same adapters again (cached). Each phase is timed with a CUDA synchronize before
and after it (`bench.common.timed`), which costs a little; the pipeline's own phases (text
encoders, VAE decode, conversion to PIL) by wrapping the engine's pipeline's methods. Fresh
pinned and pageable host buffers of each adapter's size are timed alone.

    PYTHONPATH=src python tools/bench/request_profile.py --model sdxl-random --compile-mode reduce-overhead --out r.json
"""

import argparse
import functools
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from loraswap.adapters.reference import AdapterRef
from loraswap.bench.common import timed
from loraswap.bench.serve import SPECS, prepare_adapters
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.media.images import encode_image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sdxl-random")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--compile-cache", type=Path)
    parser.add_argument("--adapters-dir", type=Path, default=Path("/tmp/loraswap-profile-adapters"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    architecture = args.model.removesuffix("-random")
    ids = prepare_adapters(architecture, args.adapters_dir, len(SPECS))
    engine = Engine(EngineConfig(model=args.model, adapters=args.adapters_dir, compile_mode=args.compile_mode,
                                 quantize=args.quantize, compile_cache=args.compile_cache))
    timers = _Timers()
    pipeline = engine.pipeline
    pipeline.encode_prompt = timers("text encoders", pipeline.encode_prompt)
    pipeline.vae.decode = timers("vae decode", pipeline.vae.decode)
    pipeline.image_processor.postprocess = timers("to PIL", pipeline.image_processor.postprocess)
    rows = []
    for round_name in ("cold", "cached"):
        for i, adapter_id in enumerate(ids):
            timers.reset()
            started = time.perf_counter()
            lease = engine.adapters.lease_now([AdapterRef(adapter_id)])
            read = time.perf_counter() - started
            with lease:
                result = engine.generate_batch([GenerateRequest(prompt="a lighthouse at dusk", seed=i,
                                                                steps=args.steps, loras=[(adapter_id, 1.0)])], lease)[0]
            encoding = time.perf_counter()
            encode_image(result.image, "JPEG")  # as the server encodes a JPEG answer
            jpeg = time.perf_counter() - encoding
            row = {"round": round_name, "adapter": SPECS[i], "read_s": read,
                   "mb": lease.held[0][0].host.nbytes / 2**20,
                   "swap_s": result.swap_seconds,
                   "pipeline_s": result.generate_seconds, **timers.last, "jpeg_s": jpeg,
                   "total_s": time.perf_counter() - started}
            row["denoise and rest_s"] = row["pipeline_s"] - sum(timers.last.values())
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    summary = {}
    for round_name in ("cold", "cached"):
        mine = [r for r in rows if r["round"] == round_name]
        summary[round_name] = {k: round(statistics.median(r[k] for r in mine), 4)
                               for k in mine[0] if k.endswith("_s") or k in timers.names}
    entries = [engine.adapters.cache.get(i) for i in ids]
    summary["host copies pinned"] = sum(bool(e and e.host.packed.is_pinned()) for e in entries)
    summary["host buffers"] = host_buffers([r["mb"] for r in rows if r["round"] == "cold"])
    report = {"model": args.model, "compile_mode": args.compile_mode, "quantize": args.quantize,
              "torch": torch.__version__, "medians": summary, "rows": rows}
    print(json.dumps(report["medians"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


def host_buffers(sizes_mb: list[float]) -> list[dict]:
    """Seconds to allocate (and fill) a fresh host buffer of each size, pinned and pageable.

    Sizes are nudged so that none is served from torch's cache of freed pinned blocks."""
    rows = []
    for i, mb in enumerate(sizes_mb):
        numel = int(mb * 2**20) // 2 + 4096 * (i + 1)
        row = {"mb": round(mb, 1)}
        for name, pinned in (("pinned", True), ("pageable", False))[0 if torch.cuda.is_available() else 1:]:
            started = time.perf_counter()
            buffer = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pinned)
            row[f"{name} alloc_s"] = time.perf_counter() - started
            buffer.fill_(1.0)
            row[f"{name} alloc+fill_s"] = time.perf_counter() - started
            del buffer
        rows.append({k: round(v, 4) for k, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


class _Timers:
    """Wraps functions to add their synchronized wall time to `last[name]`."""

    def __init__(self):
        self.last, self.names = {}, []

    def reset(self):
        self.last = {name: 0.0 for name in self.names}

    def __call__(self, name, fn):
        self.names.append(name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            seconds, result = timed(lambda: fn(*args, **kwargs))
            self.last[name] = self.last.get(name, 0.0) + seconds
            return result
        return wrapped


if __name__ == "__main__":
    main()
