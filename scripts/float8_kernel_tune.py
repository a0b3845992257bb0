"""Tile sizes of the float8 re-quantization kernel (`kernels.requantize_into`) on a GPU, at
the largest weights of FLUX.2 [dev] (rank-32 LoRA): median time per weight
(`triton.testing.do_bench`) and the rate at the kernel's own traffic (the float8 weight read
by both passes and written by the second: 3 bytes a weight).

    PYTHONPATH=src python scripts/float8_kernel_tune.py [OUT.json]
"""

import json
import sys

import torch
from triton.testing import do_bench

from loraswap.engine import kernels

SHAPES = {"single block to_qkv_mlp_proj": (55296, 6144), "single block to_out": (6144, 24576),
          "double block ff in": (36864, 6144)}
CONFIGS = [(64, 128, 32, 4), (128, 128, 32, 4), (128, 128, 32, 8), (64, 256, 32, 4), (128, 256, 32, 8),
           (256, 128, 32, 8)]


def main(out: str | None) -> None:
    torch.manual_seed(0)
    rows = []
    for name, (m, n) in SHAPES.items():
        qdata = (torch.randn(m, n, device="cuda") * 100).to(torch.float8_e4m3fn)
        scale = torch.rand(m, 1, device="cuda") * 1e-3
        pristine_q, pristine_s = qdata.clone(), scale.clone()
        up = torch.randn(m, 32, device="cuda", dtype=torch.bfloat16) * 0.01
        down = torch.randn(32, n, device="cuda", dtype=torch.bfloat16) * 0.01
        for config in CONFIGS:
            kernels.BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.NUM_WARPS = config
            ms = do_bench(lambda: kernels.requantize_into(qdata, scale, pristine_q, pristine_s, up, down, 0.8),
                          warmup=20, rep=200, return_mode="median")
            rows.append({"shape": name, "m": m, "n": n, "config": config, "ms": ms, "TBps": 3 * m * n / ms / 1e9})
            print(f"{name:30} {m}x{n} {config}: {ms:.3f} ms, {rows[-1]['TBps']:.2f} TB/s", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
