"""Which attention backend is fastest on this GPU, at the attention shapes of the real
models (bf16, 1024x1024 images): diffusers' dispatcher (`dispatch_attention_fn`, the
call `--attention` chooses for FLUX) for each backend that can run here, and agreement
with the math backend. Interleaved rounds, median per call.

    PYTHONPATH=src python tools/bench/attention_bench.py [OUT.json]
"""

import json
import statistics
import sys

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from loraswap.bench.common import cuda_ms_per_call

# (name, batch, query tokens, key tokens, heads, head dim); the dispatcher's layout is B, S, H, D
SHAPES = [
    ("flux-dev joint attention", 1, 4608, 4608, 24, 128),
    ("sdxl self-attention 64x64", 2, 4096, 4096, 10, 64),
    ("sdxl self-attention 32x32", 2, 1024, 1024, 20, 64),
    ("sdxl cross-attention 64x64", 2, 4096, 77, 10, 64),
    ("sd15 self-attention 64x64 (512 px)", 2, 4096, 4096, 8, 40),
]
BACKENDS = ["native", "_native_flash", "_native_cudnn", "_native_efficient", "_native_math"]


def main(out: str | None) -> None:
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, batch, sq, skv, heads, dim in SHAPES:
        q = torch.randn(batch, sq, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, skv, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        reference = dispatch_attention_fn(q, k, v, backend="_native_math").float()
        calls, rows = {}, {}
        for backend in BACKENDS:
            call = (lambda b: lambda: dispatch_attention_fn(q, k, v, backend=b))(backend)
            try:
                got = call().float()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a backend this GPU or build cannot run
                rows[backend] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                continue
            error = float((got - reference).norm() / reference.norm())
            calls[backend] = call
            rows[backend] = {"relative_error_vs_math": round(error, 5), "ms": []}
        for _ in range(5):  # interleaved rounds
            for backend, call in calls.items():
                rows[backend]["ms"].append(cuda_ms_per_call(call, 3 if backend == "_native_math" else 20))
        for backend in calls:
            rows[backend]["median_ms"] = round(statistics.median(rows[backend].pop("ms")), 4)
        fastest = min(calls, key=lambda b: rows[b]["median_ms"])
        report["shapes"][name] = {"backends": rows, "fastest": fastest}
        print(name, "fastest:", fastest, {b: r.get("median_ms", r.get("error")) for b, r in rows.items()}, flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
