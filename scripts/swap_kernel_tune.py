"""Check and tune the one-pass swap kernel on a GPU, on a real-size denoiser (random bf16).

1. Warm-up: compile time, then the first swaps (no compile left in them).
2. Accuracy: weights fused by the kernel and by `addmm` against the exact result
   (fp64), in bf16 ulps, for a rank-64 all-linear adapter and a blend of two.
3. Speed: the rank-64 all-linear swap from the GPU tier and from pinned host RAM, per
   tile configuration and with `addmm`, interleaved and repeated (p50 ms).
Run on a GPU machine:
    PYTHONPATH=src python scripts/swap_kernel_tune.py [flux-dev|sdxl] [ADAPTER_DIR]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraswap.bench.common import write_random_adapters
from loraswap.bench.swap_setup import bound_reader
from loraswap.engine import kernels
from loraswap.engine.swap import FusedSwapper
from loraswap.models import ARCHITECTURE_FAMILIES, architecture_denoiser
from loraswap.models.architectures import build_architecture_component

CONFIGS = [(64, 128, 32, 4), (128, 64, 32, 4), (64, 64, 32, 4), (64, 128, 16, 4), (64, 128, 64, 4),
           (32, 256, 32, 4)]


def accuracy(swapper: FusedSwapper, adapters, keys) -> str:
    """Worst error of the fused weights against the exact result (fp64), in bf16 ulps of it."""
    worst, within = 0.0, []
    for key in keys:
        weight, pristine, _ = swapper._views[key]
        exact = pristine.double()
        for bound, blend in adapters:
            if key in bound.layers:
                layer = bound.layers[key]
                exact = exact + blend * layer.scale * (layer.up.double() @ layer.down.double())
        # ulps of the larger of the result and the base weight: cancellation is judged against its operands
        scale = torch.maximum(exact.abs(), pristine.double().abs()).clamp(min=2**-120)
        ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
        error = (weight.double() - exact).abs() / ulp
        worst = max(worst, float(error.max()))
        within.append(float((error <= 1.0).double().mean()))
    return f"worst {worst:.2f} ulp, {min(within):.6f} of elements within 1 ulp"


def main(architecture: str, folder: Path) -> None:
    prefix = architecture_denoiser(architecture)
    torch.manual_seed(0)
    model = build_architecture_component(architecture, prefix, device="cuda")
    swapper = FusedSwapper({prefix: model})
    paths = write_random_adapters(architecture, [(64, "all"), (16, "all"), (128, "attn")], folder)
    read = bound_reader(ARCHITECTURE_FAMILIES[architecture].pipeline_class, prefix, model, swapper.layers)
    bound = [read(p) for p in paths]
    host = [b.to("cpu", torch.bfloat16, pin_memory=True) for b in bound]
    gpu = [b.to("cuda", torch.bfloat16) for b in bound]
    print(f"{architecture}: r64 all-linear adapter {bound[0].nbytes / 2**20:.0f} MiB over "
          f"{len(bound[0].layers)} layers", flush=True)

    # 1. compile at warm-up, then the first swaps (these also save the pristine copies)
    start = time.perf_counter()
    swapper.warm_up_kernel()
    print(f"kernel warm-up {time.perf_counter() - start:.2f} s", flush=True)
    for label, adapter in (("first swap (r16, pristine copies made)", gpu[1]), ("first r64 swap", gpu[0]),
                           ("first r128-attn swap", gpu[2])):
        print(f"{label}: {swapper.apply([(adapter, 1.0)]) * 1e3:.1f} ms", flush=True)

    # 2. accuracy against the exact result, kernel and addmm, on a sample of layers
    keys = list(bound[0].layers)[::20] + list(bound[2].layers)[::20]
    for label, adapters in (("r64-all", [(gpu[0], 1.0)]), ("blend", [(gpu[0], 0.7), (gpu[2], 0.6)])):
        for kernel in (True, False):
            swapper.kernel = kernel
            swapper.apply([(gpu[1], 1.0)])
            swapper.apply(adapters)
            print(f"accuracy {label} {'kernel' if kernel else 'addmm'}: "
                  f"{accuracy(swapper, adapters, [k for k in keys if k in swapper._views])}", flush=True)
    swapper.reset()

    # 3. speed, interleaved: for each repeat, every config on both tiers
    def time_swap(cache) -> float:
        swapper.apply([(cache[1], 1.0)])
        torch.cuda.synchronize()
        start = time.perf_counter()
        swapper.apply([(cache[0], 1.0)])
        return time.perf_counter() - start

    variants = ["addmm"] + [f"{m}x{n}x{k}w{w}" for m, n, k, w in CONFIGS]
    times = {(v, tier): [] for v in variants for tier in ("gpu", "host")}
    for repeat in range(6):
        for variant, config in zip(variants, [None] + CONFIGS):
            swapper.kernel = config is not None
            if config:
                kernels.BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.NUM_WARPS = config
            for tier, cache in (("gpu", gpu), ("host", host)):
                seconds = time_swap(cache)
                if repeat:  # the first repeat compiles
                    times[(variant, tier)].append(seconds)
    print(f"{'variant':<16}{'GPU tier ms p50':>16}{'host tier ms p50':>18}", flush=True)
    for variant in variants:
        gpu_ms = statistics.median(times[(variant, "gpu")]) * 1e3
        host_ms = statistics.median(times[(variant, "host")]) * 1e3
        print(f"{variant:<16}{gpu_ms:>16.1f}{host_ms:>18.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "flux-dev",
         Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp()))
