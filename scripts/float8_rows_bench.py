"""The one-pass activation kernel (`engine/float8_activations.py`) against torchao's activation
scaling, at FLUX.1-dev's activation shapes (1024x1024: 4,096 image and 512 text tokens).

For each shape: the kernel's output against torchao's eager `Float8Tensor.from_hp(x,
PerRow())` (bitwise, scales and values), and the median time (`triton.testing.do_bench`)
of torchao eager, torchao compiled by Inductor, the op as served, the whole-row kernel at
several warp counts and the looping kernel at several configs, with the rate in TB/s (the
activation read once, float8 values and scales written once). Then the two activations
Inductor fuses into its scaling in the real model: the single block's `cat(attention,
gelu(mlp))` before `proj_out` and the feed-forward's `gelu(h)` before its second linear
layer, compiled with torchao's scaling, compiled with the kernel after them, and done by
the kernel itself (`float8_producers`), with its values against compiled torchao's.

    PYTHONPATH=src python scripts/float8_rows_bench.py --out rows.json
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from loraswap.bench.common import environment
from loraswap.engine import float8_activations as rows_kernel

SHAPES = {"single block input": (4608, 3072), "single block proj_out input": (4608, 15360),
          "image feed-forward output": (4096, 12288), "text feed-forward output": (512, 12288)}
LOOP_CONFIGS = [(1, 1024, 8), (1, 2048, 8), (2, 1024, 8)]  # rows a program, block, warps
WHOLE_WARPS = (4, 8, 16, 32)


def torchao_rows(x: torch.Tensor):
    from torchao.quantization import Float8Tensor, PerRow

    quantized = Float8Tensor.from_hp(x, granularity=PerRow())
    return quantized.qdata, quantized.scale


def activation(rows: int, k: int) -> torch.Tensor:
    spread = torch.logspace(-2, 2, rows, device="cuda")[torch.randperm(rows, device="cuda")]
    return (torch.randn(rows, k, device="cuda") * spread[:, None]).to(torch.bfloat16)


def microseconds(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def kernel_times(x: torch.Tensor) -> dict:
    """The whole-row kernel at each warp count and the looping kernel at each of its configs."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(rows, 1, dtype=torch.float32, device="cuda")
    kernels, block = rows_kernel._kernels(), rows_kernel._power_of_two(k)
    times = {}
    for warps in WHOLE_WARPS:
        times[f"whole_{warps}w_us"] = microseconds(lambda: kernels["whole"][(rows,)](
            x, x, q, s, rows, k, k, 0, 0, ROWS=1, BLOCK=block, TAIL_BLOCK=0, GELU=False, TAIL_GELU=False,
            EMULATE=False, num_warps=warps))
    for per_program, block, warps in LOOP_CONFIGS:
        times[f"loop_{per_program}x{block}x{warps}_us"] = microseconds(lambda: kernels["loop"][(
            -(-rows // per_program),)](x, q, s, rows, k, k, ROWS=per_program, BLOCK=block, EMULATE=False, GELU=False,
                                       num_warps=warps))
    return times


def shape_row(name: str, rows: int, k: int) -> dict:
    x = activation(rows, k)
    moved = rows * k * 3 + rows * 4  # bf16 read, float8 written, fp32 scales
    reference = torchao_rows(x)
    ours = torch.ops.loraswap.float8_rows(x)
    row = {"shape": name, "rows": rows, "k": k, "scales_equal": torch.equal(ours[1], reference[1].reshape(-1, 1)),
           "values_equal": torch.equal(ours[0].view(torch.uint8), reference[0].view(torch.uint8)),
           "torchao_eager_us": microseconds(lambda: torchao_rows(x))}
    compiled = torch.compile(torchao_rows)
    row["torchao_inductor_us"] = microseconds(lambda: compiled(x))
    row["served_us"] = microseconds(lambda: torch.ops.loraswap.float8_rows(x))
    row.update(kernel_times(x))
    row["served_TBps"] = moved / row["served_us"] / 1e6
    row["inductor_TBps"] = moved / row["torchao_inductor_us"] / 1e6
    return row


def differences(ours, reference) -> dict:
    """How far the kernel's float8 values and scales are from Inductor's compiled torchao's."""
    values, expected = ours[0].float(), reference[0].float()
    differ = ours[0].view(torch.uint8) != reference[0].view(torch.uint8)
    steps = (values - expected).abs() / expected.abs().clamp(min=2**-9)
    return {"values_differ": float(differ.float().mean()),
            "largest_step_where_differ": float(steps[differ].max()) if differ.any() else 0.0,
            "scales_differ": float((ours[1].reshape(-1) != reference[1].reshape(-1)).float().mean())}


def fused_producers() -> list[dict]:
    """The activations' producers compiled with torchao's scaling, compiled with the kernel
    after them, and done by the kernel itself (`float8_producers`)."""
    attention, mlp, hidden = activation(4608, 3072), activation(4608, 12288), activation(4096, 12288)
    gelu = lambda h: F.gelu(h, approximate="tanh")  # noqa: E731
    cases = {"cat(attention, gelu(mlp))": (lambda a, m: torch.cat([a, gelu(m)], dim=1), (attention, mlp),
                                           lambda: torch.ops.loraswap.float8_rows(attention, False, mlp, True)),
             "gelu(h)": (gelu, (hidden,), lambda: torch.ops.loraswap.float8_rows(hidden, True))}
    out = []
    for name, (producer, args, by_kernel) in cases.items():
        with_torchao = torch.compile(lambda *a, p=producer: torchao_rows(p(*a)))
        with_kernel = torch.compile(lambda *a, p=producer: torch.ops.loraswap.float8_rows(p(*a)))
        out.append({"case": name, "torchao_inductor_us": microseconds(lambda: with_torchao(*args)),
                    "kernel_after_us": microseconds(lambda: with_kernel(*args)),
                    "kernel_itself_us": microseconds(by_kernel),
                    **differences(by_kernel(), with_torchao(*args))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {"env": environment(), "shapes": [shape_row(name, *shape) for name, shape in SHAPES.items()]}
    args.out.write_text(json.dumps(results, indent=2))
    results["producers"] = fused_producers()
    args.out.write_text(json.dumps(results, indent=2))
    for row in results["shapes"]:
        print(f"{row['shape']:28} {row['rows']}x{row['k']}: equal {row['scales_equal']}/{row['values_equal']}; "
              f"torchao eager {row['torchao_eager_us']:.0f} us, Inductor {row['torchao_inductor_us']:.0f} us "
              f"({row['inductor_TBps']:.2f} TB/s), served {row['served_us']:.0f} us "
              f"({row['served_TBps']:.2f} TB/s); " + " ".join(
                  f"{k[:-3]}={v:.0f}" for k, v in row.items() if k.startswith(("whole_", "loop_"))))
    for row in results["producers"]:
        print(f"{row['case']:28}", {k: round(v, 6) for k, v in row.items() if k != "case"})


if __name__ == "__main__":
    main()
