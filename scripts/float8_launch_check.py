"""On a GPU: a float8 weight's swap through its prepared launches (`float8_launch.PreparedRows`)
against Triton's own launch (`requantize_into`), bitwise, at two FLUX.1 shapes (each
tile shape), ranks 8 to 128, bf16 and fp32 factors, aligned and unaligned; and the host time of one `Fp8Weight.write`
each way on a small weight, where the GPU's work is negligible (median of 5 rounds of 2,000).

    PYTHONPATH=src python scripts/float8_launch_check.py [--out OUT.json]
"""

import argparse
import json
import statistics
import time

import torch
from torchao.quantization import Float8Tensor, PerRow

from loraswap.adapters.kinds import LORA, Layer
from loraswap.engine.float8_kernels import requantize_into
from loraswap.engine.float8_launch import PreparedRows
from loraswap.engine.float8_weights import Fp8Weight


def float8_weight(m: int, n: int) -> Fp8Weight:
    weight = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda",
                                                                                dtype=torch.bfloat16)
    return Fp8Weight(Float8Tensor.from_hp(weight, float8_dtype=torch.float8_e4m3fn, granularity=PerRow()))


def layer(m: int, n: int, rank: int, dtype: torch.dtype, offset: int = 0) -> Layer:
    """A LoRA whose factors start `offset` values into their buffers (unaligned where odd)."""
    up = torch.randn(m * rank + offset, device="cuda", dtype=dtype)[offset:].view(m, rank) * 0.02
    down = torch.randn(rank * n + offset, device="cuda", dtype=dtype)[offset:].view(rank, n) * 0.02
    return Layer(LORA, {"up": up, "down": down}, 0.5)


def check(rows: list) -> None:
    PreparedRows.enabled = True
    for m, n in [(3072, 3072), (12288, 3072)]:  # (16 x 256 and 32 x 128 tiles)
        weight = float8_weight(m, n)
        for rank, dtype in [(8, torch.bfloat16), (16, torch.bfloat16), (32, torch.bfloat16), (128, torch.bfloat16),
                            (16, torch.float32)]:
            for offset in (0, 1):
                first, second = layer(m, n, rank, dtype, offset), layer(m, n, rank, dtype, offset)
                weight.write([(first, 1.0)], kernel=True)  # Triton's launch, then prepared
                weight.write([(second, 0.7)], kernel=True)  # the prepared launch
                qdata, scale = torch.empty_like(weight.qdata), torch.empty_like(weight.scale)
                requantize_into(qdata, scale, weight.pristine_qdata, weight.pristine_scale, second.up,
                                second.down, 0.7 * second.scale)
                torch.cuda.synchronize()
                same = bool(torch.equal(qdata.view(torch.uint8), weight.qdata.view(torch.uint8))
                            and torch.equal(scale, weight.scale))
                rows.append({"shape": [m, n], "rank": rank, "dtype": str(dtype), "offset": offset,
                             "bitwise": same})
                if not same:
                    print(f"DIFFERS: {m}x{n} rank {rank} {dtype} offset {offset}", flush=True)
    print(f"prepared against Triton's launch: {sum(r['bitwise'] for r in rows)} of {len(rows)} bitwise equal",
          flush=True)


def host_times(report: dict) -> None:
    weight = float8_weight(64, 256)
    changes = [[(layer(64, 256, 16, torch.bfloat16), 1.0)] for _ in range(2)]
    for variant in ("triton", "prepared", "triton", "prepared"):
        PreparedRows.enabled = variant == "prepared"
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(2000):
                weight.write(changes[i % 2], kernel=True)
            times.append((time.perf_counter() - start) / 2000 * 1e6)
            torch.cuda.synchronize()
        report.setdefault(variant, []).append(statistics.median(times))
        print(f"Fp8Weight.write, {variant} launch: {statistics.median(times):.1f} us per call", flush=True)
    PreparedRows.enabled = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, host = [], {}
    check(rows)
    host_times(host)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "checks": rows, "host_us_per_write": host}, f, indent=1)


if __name__ == "__main__":
    main()
