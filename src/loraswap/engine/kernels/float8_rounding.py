"""Float8 in Triton kernels, for the swap's re-quantization kernels (`kernels/float8.py`) and the
activation kernel (`float8_activations.py`): where they run, and rounding to float8 e4m3 by
torchao's rule."""

import os
from functools import cache

import torch


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs kernels (`TRITON_INTERPRET=1`: the unit tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def float8_runs_on(device: torch.device) -> bool:
    """Whether float8 Triton kernels run on `device`: CUDA of compute capability 8.9 and
    later (Triton has float8 e4m3 there), or any device under the interpreter."""
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


@cache
def float8_rounding():
    """A Triton function (None without Triton): fp32 values already divided by their scale,
    clamped to +-448, to be stored as float8 e4m3, rounded by torchao's rule (nearest, ties
    to even; NaN stays NaN). On a GPU the store's own conversion rounds so (one instruction
    for two values); with `EMULATE` (Triton's interpreter, whose cast is wrong where rounding
    carries into the exponent) the value is rounded here, in fp32 bit operations, and the
    cast is then exact."""
    global tl  # Triton's interpreter looks for its language in the module of a function it runs
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def round_to_float8(q, EMULATE: tl.constexpr):
        q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)  # 448: float8 e4m3's largest
        if not EMULATE:
            return q
        # normal values keep 3 of fp32's 23 mantissa bits; below 2**-6 the step is 2**-9
        bits = q.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        tiny = ((tl.abs(q) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # 1.5 * 2**23 rounds to integers
        subnormal = (tiny.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # sign
        # NaN (0 / 0 in an all-zero row) stays NaN on a GPU, as in torchao (not in the interpreter)
        return tl.where(q != q, q, tl.where(tl.abs(q) < 0.015625, subnormal, normal))

    return round_to_float8
