"""The one-pass activation kernel (`engine/quantize/float8_activations.py`) against torchao's activation
scaling, at FLUX.1-dev's activation shapes (1024x1024: 4,096 image and 512 text tokens).

For each shape: the kernel's output (`torch.ops.loraswap.float8_rows`, as served) against
torchao's eager `Float8Tensor.from_hp(x, PerRow())` (bitwise, scales and values), and the
median time (`triton.testing.do_bench`) of torchao eager, torchao compiled by Inductor and
the kernel, with the rate in TB/s (the activation read once, float8 values and scales
written once). Then the two activations Inductor fuses into its scaling in the real
model, compiled both ways: the single block's `cat(attention, gelu(mlp))` before
`proj_out` and the feed-forward's `gelu(h)` before its second linear layer; and the GELU
computed by the kernel itself (`gelu=True`).

    PYTHONPATH=src python tools/bench/float8_rows_bench.py --out rows.json
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from loraswap.bench.common import environment
from loraswap.engine.quantize import float8_activations  # noqa: F401 - defines torch.ops.loraswap.float8_rows

SHAPES = {"single block input": (4608, 3072), "single block proj_out input": (4608, 15360),
          "image feed-forward output": (4096, 12288), "text feed-forward output": (512, 12288)}


def torchao_rows(x: torch.Tensor):
    from torchao.quantization import Float8Tensor, PerRow

    quantized = Float8Tensor.from_hp(x, granularity=PerRow())
    return quantized.qdata, quantized.scale


def activation(rows: int, k: int) -> torch.Tensor:
    spread = torch.logspace(-2, 2, rows, device="cuda")[torch.randperm(rows, device="cuda")]
    return (torch.randn(rows, k, device="cuda") * spread[:, None]).to(torch.bfloat16)


def microseconds(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


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
    row["kernel_us"] = microseconds(lambda: torch.ops.loraswap.float8_rows(x))
    row["kernel_TBps"] = moved / row["kernel_us"] / 1e6
    row["inductor_TBps"] = moved / row["torchao_inductor_us"] / 1e6
    return row


def fused_producers() -> list[dict]:
    """The activations' producers compiled with torchao's scaling and with the kernel."""
    attention, mlp = activation(4608, 3072), activation(4608, 12288)
    hidden = activation(4096, 12288)
    cases = {"cat(attention, gelu(mlp))": (lambda a, m: torch.cat([a, F.gelu(m, approximate="tanh")], dim=1),
                                           (attention, mlp)),
             "gelu(h)": (lambda h: F.gelu(h, approximate="tanh"), (hidden,))}
    out = []
    for name, (producer, args) in cases.items():
        with_torchao = torch.compile(lambda *a, p=producer: torchao_rows(p(*a)))
        with_kernel = torch.compile(lambda *a, p=producer: torch.ops.loraswap.float8_rows(p(*a)))
        out.append({"case": name, "torchao_inductor_us": microseconds(lambda: with_torchao(*args)),
                    "kernel_us": microseconds(lambda: with_kernel(*args))})
    # the GELU read by the kernel itself (its pre-activation input, no bf16 output in between)
    q, _ = torch.ops.loraswap.float8_rows(hidden, True)
    reference = torchao_rows(F.gelu(hidden, approximate="tanh"))
    out[-1]["kernel_with_gelu_inside_us"] = microseconds(lambda: torch.ops.loraswap.float8_rows(hidden, True))
    out[-1]["gelu_inside_values_differ"] = float((q.view(torch.uint8) != reference[0].view(torch.uint8)).float().mean())
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
              f"({row['inductor_TBps']:.2f} TB/s), kernel {row['kernel_us']:.0f} us ({row['kernel_TBps']:.2f} TB/s)")
    for row in results["producers"]:
        print(f"{row['case']:28} compiled: torchao scaling {row['torchao_inductor_us']:.0f} us, "
              f"kernel {row['kernel_us']:.0f} us", {k: v for k, v in row.items() if "inside" in k})


if __name__ == "__main__":
    main()
