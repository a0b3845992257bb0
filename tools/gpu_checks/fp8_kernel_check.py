"""The float8 re-quantization kernel on a GPU, against the eager path it replaces, on
FLUX.1-sized weights: agreement (scales, float8 values) and time per swap of one layer, for
one LoRA and for a blend of two (the second of half the rank, weight -0.5), and with a scale
per row for one LoHa, one LoKr and DoRA over a LoRA (PEFT's and LyCORIS's rescaling of output rows).

    PYTHONPATH=src python tools/gpu_checks/fp8_kernel_check.py [OUT.json]
"""

import itertools
import json
import statistics
import sys

import torch
from torchao.quantization import Float8Tensor, PerRow, PerTensor

from loraswap.adapters.kinds import LOHA, LOKR, LORA, Layer
from loraswap.engine.swap.float8_weights import Fp8Weight


def timed(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def lora(rows: int, cols: int, rank: int) -> Layer:
    return Layer(LORA, {"up": torch.randn(rows, rank, device="cuda", dtype=torch.bfloat16) * 0.01,
                        "down": torch.randn(rank, cols, device="cuda", dtype=torch.bfloat16) * 0.01})


def changes(kind: str, rows: int, cols: int, rank: int) -> list:
    """A swap's (layer, weight) pairs of this kind."""
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.01  # noqa: E731
    if kind == "blend":
        return [(lora(rows, cols, rank), 0.8), (lora(rows, cols, rank // 2), -0.5)]
    if kind == "loha":
        return [(Layer(LOHA, {"w1a": rand(rows, rank), "w1b": rand(rank, cols), "w2a": rand(rows, rank) * 100,
                              "w2b": rand(rank, cols) * 100}), 0.8)]
    if kind == "lokr":  # kron(w1 of 8 x 16, w2 of rows / 8 x cols / 16 at this rank; 1 x 16 where 8 does not divide)
        a = 8 if rows % 8 == 0 else 1
        factors = {"w1": rand(a, 16) * 100, "w2a": rand(rows // a, rank), "w2b": rand(rank, cols // 16)}
        return [(Layer(LOKR, factors), 0.8)]
    if kind.startswith("dora"):
        factors = lora(rows, cols, rank).factors | {"magnitude": torch.rand(rows, device="cuda") + 0.5}
        return [(Layer(LORA, factors, dora=kind.removeprefix("dora-")), 0.8)]
    return [(lora(rows, cols, rank), 0.8)]


# (rows, columns, rank): whole tiles and rank blocks (no masks); rank 16 (a block of 16 ranks,
# 32 x 128 tiles); rank 128; a tall weight (32 x 128, FLUX.2's fused projection); a row short of
# whole tiles; rank 8 (masked ranks)
SHAPES = ((3072, 12288, 64), (12288, 3072, 16), (3072, 3072, 128), (36864, 6144, 32), (3071, 3072, 32),
          (3072, 3072, 8))
KINDS = {"PerRow": ("lora", "blend", "loha", "lokr", "dora-peft", "dora-lycoris-out"), "PerTensor": ("lora", "blend")}


def main(out: str | None) -> None:
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for granularity in (PerRow(), PerTensor()):
        for (rows, cols, rank), kind in itertools.product(SHAPES, KINDS[type(granularity).__name__]):
            hp = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
            change = changes(kind, rows, cols, rank)
            results = {}
            for kernel in (True, False):
                weight = Float8Tensor.from_hp(hp, float8_dtype=torch.float8_e4m3fn, granularity=granularity)
                fp8 = Fp8Weight(weight)
                fp8.write(change, kernel=kernel)
                results[kernel] = (weight.qdata.clone(), weight.scale.clone(),
                                   timed(lambda: fp8.write(change, kernel=kernel)))
            (q, s, ms), (q_eager, s_eager, ms_eager) = results[True], results[False]
            differs = q.view(torch.uint8) != q_eager.view(torch.uint8)
            steps = (q.float() - q_eager.float()).abs() / q_eager.float().abs().clamp(min=2**-9)
            case = {"granularity": type(granularity).__name__, "shape": [rows, cols], "rank": rank, "kind": kind,
                    "scale_max_rel_diff": float(((s - s_eager).abs() / s_eager).max()),
                    "qdata_differ_fraction": float(differs.float().mean()),
                    "max_relative_step_where_differ": float(steps[differs].max()) if differs.any() else 0.0,
                    "kernel_ms": ms, "eager_ms": ms_eager, "speedup": ms_eager / ms}
            report["cases"].append(case)
            print(case, flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
