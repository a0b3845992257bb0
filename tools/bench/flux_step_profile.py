"""Where a float8 transformer's step time goes on the GPU, by kernel, for the ways of
running it in float8: FLUX.1-dev by default, or FLUX.2 [dev], Qwen-Image or Wan 2.2
(`--architecture`; Wan's first expert).

Builds the transformer (real config, random weights) once, then one model per variant,
each compiled as the engine would (regional compile):
- `bf16`: the transformer as built, unquantized (the reference the others are compared with);
- `torchao`: quantized (`--quantize`), torchao's own activation scaling, fused by Inductor;
- `one-pass`: quantized, the output projections' activations scaled by loraswap's kernel
  (`float8_activations`), as the engine serves `--quantize fp8`;
- `one-pass-all`: the kernel on every float8 linear layer;
- `one-pass-gelu`: as `one-pass`, with the feed-forwards' GELU applied by the kernel of
  their second layer (`use_float8_gelu_rows`);
- `fused-qkv`: as `one-pass`, with diffusers' `fuse_qkv_projections` (one q/k/v matmul per
  stream instead of three, the separate projections dropped).
Times `--steps` denoiser calls per image in interleaved rounds, compares one call's output
with the first variant's, and profiles `--profile-steps` calls of each variant with
torch.profiler: GPU time per step in matmuls, attention, Inductor's fused (Triton)
kernels, loraswap's activation kernel and the rest, and the slowest kernels. `--on-host`
builds in host RAM and quantizes each variant onto the GPU (models whose bf16 copy does not
fit beside their float8 ones; no `bf16` variant then).

    PYTHONPATH=src python tools/bench/flux_step_profile.py --out flux-steps.json
    PYTHONPATH=src python tools/bench/flux_step_profile.py --architecture wan-14b --on-host --size 832 --height 480 \
        --variants torchao,one-pass --out wan-steps.json
"""

import argparse
import copy
import json
import logging
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from loraswap.bench.common import environment, gpu_kernel_times, timed
from loraswap.bench.swap import Denoise
from loraswap.bench.swap_setup import denoiser_inputs
from loraswap.engine.quantize.float8_activations import use_float8_gelu_rows, use_float8_rows
from loraswap.engine.quantize.weights import float8_config, quantize_module
from loraswap.engine.startup.compile import compile_denoiser
from loraswap.models.architectures import build_architecture_component

VARIANTS = ("bf16", "torchao", "one-pass", "one-pass-all", "one-pass-gelu", "fused-qkv")
SEPARATE_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
CATEGORIES = (  # first match wins; Inductor names its kernels after the ops they fuse (`_scaled_mm` for
    # an activation's float8 scaling), so its own come first; then cuDNN/FlashAttention, cuBLAS/CUTLASS
    ("inductor (triton)", re.compile(r"^triton_", re.I)),
    ("activation kernel", re.compile(r"^quantize_rows", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|sm90_|nvjet|f8f8|cublas", re.I)),
)


def category(kernel: str) -> str:
    return next((name for name, pattern in CATEGORIES if pattern.search(kernel)), "other")


def build(base: torch.nn.Module | None, built, variant: str, quantize: str, device) -> torch.nn.Module:
    """`variant` of the transformer: the base itself (bf16), else a copy of it or, without a
    base (`--on-host`), a fresh build of the same weights (`built()`), changed and compiled."""
    if variant == "bf16":  # the base itself: one copy fewer in memory
        if base is None:
            raise ValueError("no bf16 variant with --on-host")
        compile_denoiser(base, "default")
        return base
    model = copy.deepcopy(base) if base is not None else built()
    if variant == "fused-qkv":
        model.fuse_qkv_projections()
        for module in model.modules():  # the fused copies replace them; keep the memory
            if getattr(module, "fused_projections", False):
                for name in SEPARATE_PROJECTIONS:
                    if hasattr(module, name):
                        delattr(module, name)
    elif variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant}; choose from {', '.join(VARIANTS)}")
    if variant == "torchao":  # torchao's quantization alone: its activation scaling on every layer
        from torchao.quantization import quantize_

        quantize_(model, float8_config(quantize), device=device)
    else:
        quantize_module(model, quantize, device)
    model.to(device)  # (what quantizing left where it was built: norms, embeddings)
    if variant == "one-pass-all":
        use_float8_rows(model, names=None)
    if variant == "one-pass-gelu":
        use_float8_gelu_rows(model)
    compile_denoiser(model, "default")
    return model


def kernel_profile(denoise: Denoise, steps: int) -> dict:
    times = gpu_kernel_times(lambda: denoise(steps), steps)
    by_category: dict[str, float] = defaultdict(float)
    for name, (ms, _) in times.items():
        by_category[category(name)] += ms
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:25]
    return {"ms_per_step": sum(ms for ms, _ in times.values()),
            "by_category_ms_per_step": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "launches_per_step": sum(n for _, n in times.values()),
            "top_kernels": [{"name": name[:160], "category": category(name), "ms_per_step": ms,
                             "calls_per_step": n} for name, (ms, n) in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", default="fp8")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--variants", default="bf16,torchao,one-pass")
    parser.add_argument("--architecture", default="flux-dev", help="flux-dev, flux2-dev, qwen-image, wan-14b")
    parser.add_argument("--size", type=int, default=1024, help="width (and height, without --height)")
    parser.add_argument("--height", type=int)
    parser.add_argument("--frames", type=int, default=33, help="a video model's frames")
    parser.add_argument("--on-host", action="store_true", help="build in host RAM, quantize onto the GPU")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device, dtype = torch.device("cuda"), torch.bfloat16
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    height = args.height or args.size
    results = {"env": environment(), "architecture": args.architecture, "quantize": args.quantize,
               "steps": args.steps, "size": [args.size, height], "frames": args.frames, "variants": variants,
               "rows": []}

    def save():
        args.out.write_text(json.dumps(results, indent=2))

    def built() -> torch.nn.Module:  # the same random weights on every call (drawn on the GPU)
        torch.manual_seed(0)
        return build_architecture_component(args.architecture, "transformer", init_device=device, dtype=dtype,
                                            device="cpu" if args.on_host else device)

    base = None if args.on_host else built()
    inputs = denoiser_inputs(base or build_architecture_component(args.architecture, "transformer"), args.size,
                             height, device, dtype, frames=args.frames)
    models = {}
    for name in sorted(variants, key=lambda v: v == "bf16"):  # bf16 compiles the base itself: copied first
        models[name] = Denoise(build(base, built, name, args.quantize, device), inputs, args.steps)
        results[f"compile_{name}_s"] = timed(lambda: models[name](2))[0]
        print(f"{name}: built and compiled, warm-up {results[f'compile_{name}_s']:.1f} s", flush=True)
    del base
    torch.cuda.empty_cache()
    outputs = {name: denoise(1).float().clone() for name, denoise in models.items()}
    first = outputs[variants[0]]
    results["rel_diff_vs_first"] = {name: float((out - first).norm() / first.norm()) for name, out in outputs.items()}
    for r in range(args.rounds):
        for name in variants[r % len(variants):] + variants[: r % len(variants)]:
            seconds = timed(models[name])[0]
            results["rows"].append({"round": r, "variant": name, "image_s": seconds})
            print(f"round {r} {name}: {seconds:.3f} s per image", flush=True)
        save()
    results["median_image_s"] = {name: statistics.median(row["image_s"] for row in results["rows"]
                                                           if row["variant"] == name) for name in variants}
    for name in variants:
        results[f"profile_{name}"] = profile = kernel_profile(models[name], args.profile_steps)
        print(f"{name}: {profile['ms_per_step']:.1f} ms GPU per step, {profile['launches_per_step']:.0f} launches; "
              + ", ".join(f"{k} {v:.1f}" for k, v in profile["by_category_ms_per_step"].items()), flush=True)
        for row in profile["top_kernels"][:12]:
            print(f"   {row['ms_per_step']:7.2f} ms x{row['calls_per_step']:.0f} {row['category']:18} "
                  f"{row['name'][:90]}")
        save()
    results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    print(json.dumps({"median_image_s": results["median_image_s"], "rel_diff_vs_first": results["rel_diff_vs_first"]}))


if __name__ == "__main__":
    main()
