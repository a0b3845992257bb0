"""The float8 re-quantization kernel (`Fp8Weight.write(..., kernel=True)`) on a GPU against
the eager path it replaces, on FLUX.1-sized weights: with a scale per row for one LoRA, a
blend of two (the second of half the rank, weight -0.5), one LoHa, one LoKr and DoRA over a
LoRA (PEFT's and LyCORIS's rescaling of output rows); with one scale per tensor for a LoRA
and a blend. The scales agree to fp32's rounding and the few float8 values that differ
(summation order) are one float8 step apart. The time per swap of one layer, each way, is
evidence (`fp8-kernel-check.json`), not a check."""

import itertools
import statistics

import pytest
import torch

from loraswap.adapters.kinds import LOHA, LOKR, LORA, Layer
from loraswap.engine.swap.float8_weights import Fp8Weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (rows, columns, rank): whole tiles and rank blocks (no masks); rank 16 (a block of 16 ranks,
# 32 x 128 tiles); rank 128; a tall weight (32 x 128, FLUX.2's fused projection); a row short of
# whole tiles; rank 8 (masked ranks)
SHAPES = ((3072, 12288, 64), (12288, 3072, 16), (3072, 3072, 128), (36864, 6144, 32), (3071, 3072, 32),
          (3072, 3072, 8))
KINDS = {"PerRow": ("lora", "blend", "loha", "lokr", "dora-peft", "dora-lycoris-out"), "PerTensor": ("lora", "blend")}
CASES = [(granularity, shape, kind) for granularity, kinds in KINDS.items()
         for shape, kind in itertools.product(SHAPES, kinds)]

SCALE_RELATIVE = 2e-6  # a few fp32 roundings (measured on H100s: at most 6.7e-7)
DIFFER_FRACTION = 1e-4  # of the float8 values (measured on H100s: at most 4.7e-6)


def timed_ms(fn, repeats: int = 20) -> float:
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


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.01


def lora(rows: int, cols: int, rank: int) -> Layer:
    return Layer(LORA, {"up": rand(rows, rank), "down": rand(rank, cols)})


def changes(kind: str, rows: int, cols: int, rank: int) -> list:
    """A swap's (layer, weight) pairs of this kind."""
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


def float8_order(qdata: torch.Tensor) -> torch.Tensor:
    """Each e4m3 value's place on the number line, counted in float8 steps from zero (codes
    are sign and magnitude; +0 and -0 both 0)."""
    code = qdata.view(torch.uint8).to(torch.int16)
    magnitude = code & 0x7F
    return torch.where(code >= 0x80, -magnitude, magnitude)


@pytest.mark.parametrize("granularity,shape,kind", CASES,
                         ids=[f"{g}-{r}x{c}-r{k}-{kind}" for g, (r, c, k), kind in CASES])
def test_the_kernel_writes_what_the_eager_path_writes(granularity, shape, kind, evidence):
    from torchao.quantization import Float8Tensor, PerRow, PerTensor

    torch.manual_seed(0)
    rows, cols, rank = shape
    hp = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    change = changes(kind, rows, cols, rank)
    results = {}
    for kernel in (True, False):
        weight = Float8Tensor.from_hp(hp, float8_dtype=torch.float8_e4m3fn,
                                      granularity={"PerRow": PerRow(), "PerTensor": PerTensor()}[granularity])
        fp8 = Fp8Weight(weight)
        fp8.write(change, kernel=kernel)
        results[kernel] = (weight.qdata.clone(), weight.scale.clone(),
                           timed_ms(lambda: fp8.write(change, kernel=kernel)))
    (q, s, ms), (q_eager, s_eager, ms_eager) = results[True], results[False]
    differs = q.view(torch.uint8) != q_eager.view(torch.uint8)
    steps_apart = (float8_order(q) - float8_order(q_eager)).abs()
    row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "granularity": granularity,
           "shape": [rows, cols], "rank": rank, "kind": kind,
           "scale_max_rel_diff": float(((s - s_eager).abs() / s_eager).max()),
           "qdata_differ_fraction": float(differs.float().mean()),
           "most_float8_steps_apart": int(steps_apart.max()),
           "kernel_ms": ms, "eager_ms": ms_eager, "speedup": ms_eager / ms}
    evidence("fp8-kernel-check.json", row)
    assert row["scale_max_rel_diff"] <= SCALE_RELATIVE, row
    assert row["qdata_differ_fraction"] <= DIFFER_FRACTION, row
    assert row["most_float8_steps_apart"] <= 1, row
