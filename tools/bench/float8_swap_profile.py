"""Where a float8 swap's time goes on the GPU: one architecture's denoiser (real config,
random weights) quantized with `--quantize fp8`, a rank-`--rank` adapter on every linear
layer swapped in from the GPU cache, as the server swaps it.

Reports, per swap: wall time (median of `--rounds`), the GPU's busy time by kernel (the
re-quantization kernel's two passes, copies, the scale's small ops), kernel launches, the
float8 bytes the swap must move at least (each touched weight's pristine copy read and the
weight written: two bytes per weight) and the rate that gives, and how many layers took
the kernel and how many the eager path (several changes on one weight, kinds other than a
plain LoRA), with their share of the bytes.

    PYTHONPATH=src python tools/bench/float8_swap_profile.py --architecture flux2-dev --out swap-profile.json
"""

import argparse
import json
import logging
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from loraswap.bench.common import environment, gpu_kernel_times, timed, write_random_adapters
from loraswap.bench.swap_setup import bound_reader, build_denoiser
from loraswap.engine.quantize.weights import quantize_module
from loraswap.engine.swap.fused import FusedSwapper
from loraswap.models import lora_components
from loraswap.models.architectures import build_architecture_component
from loraswap.models.presets import PRESETS, build_preset


def routes(swapper: FusedSwapper, adapter) -> dict:
    """Layers (and their float8 bytes) by the path their re-quantization takes."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    float8 = swapper.float8_layers
    for key, layer in adapter.layers.items():
        if key not in float8:
            route = "not float8"
            nbytes = 0
        else:
            qdata = swapper.layers.params[key].data.qdata  # the float8 values of torchao's `Float8Tensor`
            route = "kernel" if layer.plain and qdata.is_contiguous() else f"eager ({layer.kind.label})"
            nbytes = qdata.nbytes
        counts[route][0] += 1
        counts[route][1] += nbytes
    return {route: {"layers": n, "GiB": b / 2**30} for route, (n, b) in counts.items()}


def kernel_profile(swap, swaps: int) -> dict:
    times = gpu_kernel_times(lambda: [swap() for _ in range(swaps)], swaps)
    top = sorted(times.items(), key=lambda kv: -kv[1][0])
    return {"gpu_busy_ms": sum(ms for ms, _ in times.values()),
            "launches": sum(n for _, n in times.values()),
            "kernels": [{"name": name[:120], "ms": ms, "calls": n} for name, (ms, n) in top[:20]]}


def build_denoisers(architecture: str, device, dtype, quantize: str, on_host: bool) -> tuple[dict, str, type]:
    """The denoiser(s) as served, each quantized as built: Wan 2.2's two experts, else one.
    `on_host`: built in host RAM and quantized layer by layer onto `device` (FLUX.2 [dev] in
    bf16 does not fit an 80 GB GPU beside its float8 copy)."""
    build = torch.device("cpu") if on_host else device

    def quantized(module: torch.nn.Module) -> torch.nn.Module:
        quantize_module(module, quantize, device)
        return module.to(device)  # what quantizing left in host RAM: norms, embeddings

    model, prefix, pipeline_cls = build_denoiser(architecture, build, dtype)
    models = {prefix: quantized(model)}
    if "transformer_2" in lora_components(architecture)[1]:
        models["transformer_2"] = quantized(
            build_preset(architecture).transformer_2.to(build, dtype) if architecture in PRESETS
            else build_architecture_component(architecture, "transformer_2", device=build, dtype=dtype))
    return models, prefix, pipeline_cls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="flux2-dev")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quantize", default="fp8", help="fp8-weight-only for a dry run on a CPU")
    parser.add_argument("--on-host", action="store_true", help="build in host RAM (FLUX.2 on an 80 GB GPU)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    models, prefix, pipeline_cls = build_denoisers(args.architecture, device, dtype, args.quantize, args.on_host)
    model = models[prefix]
    swapper = FusedSwapper(models)
    swapper.warm_up_kernel()
    read = bound_reader(pipeline_cls, prefix, model, swapper.layers)
    paths = write_random_adapters(args.architecture, [(args.rank, "all")] * 2, Path(tempfile.mkdtemp()))
    adapters = [read(p).to(device, dtype) for p in paths]
    for adapter in adapters:  # pristine copies are made on first touch: keep that out
        swapper.apply([(adapter, 1.0)])
    results = {"env": environment(), "architecture": args.architecture, "rank": args.rank,
               "adapter_MiB": paths[0].stat().st_size / 2**20, "routes": routes(swapper, adapters[0])}
    touched = sum(r["GiB"] for r in results["routes"].values()) * 2**30
    turn = iter(range(10**9))
    swap = lambda: swapper.apply([(adapters[next(turn) % 2], 1.0)])  # noqa: E731
    walls = [timed(swap)[0] * 1e3 for _ in range(args.rounds)]
    results["swap_ms"] = {"p50": statistics.median(walls), "min": min(walls), "all": walls}
    results["profile"] = profile = kernel_profile(swap, 3)
    results["float8_bytes_GB"] = 2 * touched / 1e9
    results["floor_rate_TBps_at_wall"] = 2 * touched / 1e12 / (results["swap_ms"]["p50"] / 1e3)
    results["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    args.out.write_text(json.dumps(results, indent=2))
    print(f"{args.architecture}: swap p50 {results['swap_ms']['p50']:.1f} ms, "
          f"GPU busy {profile['gpu_busy_ms']:.1f} ms, "
          f"{profile['launches']:.0f} launches, {results['float8_bytes_GB']:.1f} GB at least "
          f"({results['floor_rate_TBps_at_wall']:.2f} TB/s at the wall time); routes {results['routes']}")
    for row in profile["kernels"][:10]:
        print(f"   {row['ms']:7.2f} ms x{row['calls']:.0f} {row['name'][:100]}")


if __name__ == "__main__":
    main()
