"""Row-wise float8 activations in one pass: the input of a float8 linear layer (`--quantize
fp8`) scaled by a Triton kernel of our own instead of torchao's torch ops.

torchao quantizes each activation row as `x / s` with `s = amax(|row|) / 448` (the division
in the activation's dtype), through ops that Inductor fuses into the kernel producing the
activation: one pass reads it for the largest value, another reads it again to scale it,
well under the GPU's bandwidth at rows of 3,072 to 24,576 values (FLUX.1, FLUX.2). torchao's own
one-pass kernel (`mslk`'s `quantize_fp8_row`) is not published on PyPI for this CUDA. Here
one program scales a row: the first loop finds the largest value, the second reads the row
again from the L2 cache (at most 48 KB), scales, rounds and stores it. Its output is
torchao's bitwise (same scale, same rounding), but for an all-zero row: torchao divides 0 by
0 there and writes NaN, the kernel writes zeros. On an H200 it scales FLUX.1's activations
3.5 to 13 times faster than Inductor's fused torchao ops
(bench/results/float8-h200/activation-kernel.json).

It is an opaque op to compiled graphs, so it pays only where Inductor cannot fuse better:
the output projections (`OUTPUT_PROJECTIONS`: attention outputs and the feed-forward's
second layer), whose input comes from attention or an activation function and feeds no
other layer (and the last `proj_out`, fed by the output norm alone). A layer that shares a
norm's output with others (q, k and v; FLUX.1's MLP beside them) keeps torchao's scaling,
which Inductor fuses into the norm's kernel and computes once for all of them; the kernel
on every layer made a FLUX.1 step slower (96.3 ms against 92.8), on the output projections
faster (90.0 against 92.4; bench/results/float8-h200/). On an H100 the feed-forwards'
second layers of the other families gain too: a step of FLUX.2 274.9 against 281.6 ms,
Wan 2.2 636.9 against 642.2, Qwen-Image 98.4 against 99.1
(bench/results/float8-h100-2026-12-06b/).

`use_float8_rows(module)` switches those layers to this path; their weights stay torchao's
`Float8Tensor`, so the swap re-quantizes them in place as before, and the matmul is the
`torch._scaled_mm` torchao calls.
"""

import logging
from functools import cache

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward
from torch import nn

from loraswap.engine.kernels.float8_rounding import float8_rounding, float8_runs_on
from loraswap.engine.kernels.fused import triton_cdiv

logger = logging.getLogger(__name__)

BLOCK = 1024  # values of a row a program loads at a time (best at every FLUX.1 shape on an H200)
ROWS = 1  # rows a program scales (more under Triton's interpreter, where each program costs)
NUM_WARPS = 8


@cache
def rows_kernel():
    """The Triton kernel `float8_rows` launches, or None without Triton (built once, on first
    use, with the Triton functions it calls, `to_bfloat16` among them, as this module's globals)."""
    global round_to_float8, _largest, to_bfloat16, _activation, tl  # Triton looks these up in the kernel's module
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    round_to_float8 = float8_rounding()

    @triton.jit
    def _largest(a, b):  # NaN wins, as in torch's amax
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def to_bfloat16(value):
        """fp32 values rounded to bf16's precision (nearest, ties to even), kept in fp32; NaN
        stays NaN (the GPU's NaN, 0x7FFFFFFF, would carry into the sign bit: -0.0)."""
        bits = value.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
        return tl.where(value != value, value, rounded)

    @triton.jit
    def _activation(value, GELU: tl.constexpr):
        """The loaded bf16 values in fp32; with GELU, tanh-GELU's bf16 output (as torch's)."""
        value = value.to(tl.float32)
        if GELU:
            inner = 0.7978845608028654 * (value + 0.044715 * value * value * value)
            value = to_bfloat16(0.5 * value * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0)))
        return value

    @triton.jit(do_not_specialize=["M", "stride"])
    def quantize_rows(x_ptr, q_ptr, s_ptr, M, K, stride, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      EMULATE: tl.constexpr, GELU: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        in_m = rows < M
        cols = tl.arange(0, BLOCK)
        source, target = x_ptr + rows[:, None] * stride, q_ptr + rows[:, None] * K
        largest = tl.full([ROWS, BLOCK], 0.0, tl.float32)  # (tl.zeros: a jit function the interpreter cannot call)
        for start in range(0, K, BLOCK):
            at = start + cols[None, :]
            value = _activation(tl.load(source + at, mask=in_m[:, None] & (at < K), other=0.0), GELU)
            largest = _largest(largest, tl.abs(value))
        # Triton's own max (the interpreter runs it in numpy; it may drop NaN), then NaN put
        # back in the rows that had one
        amax = tl.reduce(largest, 1, tl.standard._elementwise_max)
        nan_seen = tl.reduce((largest != largest).to(tl.float32), 1, tl.standard._elementwise_max)
        # torchao divides in the activation's dtype, bf16
        scale = to_bfloat16(tl.math.div_rn(tl.where(nan_seen > 0, float("nan"), amax), 448.0))
        tl.store(s_ptr + rows, scale, mask=in_m)
        divisor = tl.where(scale == 0.0, 1.0, scale)[:, None]  # an all-zero row: zeros, not 0 / 0
        for start in range(0, K, BLOCK):
            at = start + cols[None, :]
            mask = in_m[:, None] & (at < K)
            value = _activation(tl.load(source + at, mask=mask, other=0.0), GELU)
            quantized = round_to_float8(tl.math.div_rn(value, divisor), EMULATE)
            tl.store(target + at, quantized.to(q_ptr.dtype.element_ty), mask=mask)

    return quantize_rows


# an opaque custom op: compiled graphs call it as it is (Inductor's own launch of a user's
# Triton kernel, `torch.library.triton_op`, failed on torch 2.11 with Triton 3.6)
@torch.library.custom_op("loraswap::float8_rows", mutates_args=())
def float8_rows(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D bf16 activation with rows of unit stride as float8 e4m3 values and
    one fp32 scale per row ([rows, 1]), as torchao's `Float8Tensor.from_hp(x, PerRow())`;
    with `gelu`, of tanh-GELU(x) (rounded to bf16 first, as torch's GELU returns it)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    quantized = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(BLOCK, 1 << (k - 1).bit_length())
        per_program = ROWS if x.is_cuda else 64  # the interpreter (CPU tensors) pays per program
        rows_kernel()[(triton_cdiv(rows, per_program),)](
            x, quantized, scale, rows, k, x.stride(0), ROWS=per_program, BLOCK=block, EMULATE=not x.is_cuda, GELU=gelu,
            num_warps=NUM_WARPS)
    return quantized, scale


@float8_rows.register_fake
def _(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


class Float8RowsLinear(nn.Linear):
    """A linear layer with a torchao `Float8Tensor` weight (row-wise scales), whose input is
    quantized by `float8_rows` and multiplied as torchao does (`torch._scaled_mm`, the
    weight's own fast-accumulation setting). Other activation dtypes take torchao's path."""

    gelu_input = False  # the input is a GELU's (`Float8GeluRowsLinear`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return super().forward(F.gelu(x, approximate="tanh") if self.gelu_input else x)
        weight = self.weight
        quantized, scale = torch.ops.loraswap.float8_rows(x.reshape(-1, x.shape[-1]), self.gelu_input)
        out = torch._scaled_mm(quantized, weight.qdata.t(), scale_a=scale, scale_b=weight.scale.t(), bias=self.bias,
                               out_dtype=x.dtype, use_fast_accum=weight.mm_config.use_fast_accum)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Float8GeluRowsLinear(Float8RowsLinear):
    """A feed-forward's second layer whose input is the first layer's output before its
    tanh-GELU: the kernel applies the GELU as it reads (`use_float8_gelu_rows`)."""

    gelu_input = True


class _WithoutGelu(GELU):
    """diffusers' GELU module (a linear layer, then GELU) without the GELU: the next layer
    applies it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_states)


def use_float8_gelu_rows(module: nn.Module) -> int:
    """In every feed-forward of `module` (diffusers' `FeedForward`: tanh-GELU module, dropout,
    a `Float8RowsLinear`), the GELU moved into the second layer's kernel, so that its output
    is never written in bf16; returns how many were changed."""
    changed = 0
    for layer in module.modules():
        net = getattr(layer, "net", None)
        if isinstance(layer, FeedForward) and len(net) == 3 and type(net[0]) is GELU \
                and net[0].approximate == "tanh" and isinstance(net[1], nn.Dropout) \
                and type(net[2]) is Float8RowsLinear:
            net[0].__class__, net[2].__class__ = _WithoutGelu, Float8GeluRowsLinear
            changed += 1
    return changed


def _takes_float8_rows(module: nn.Module) -> bool:
    """A plain linear layer whose weight torchao quantized to float8 e4m3 with row-wise
    scales, bf16, and row-wise dynamic activations, unbounded (the configuration `fp8` makes)."""
    weight = getattr(module, "weight", None)
    if type(module) is not nn.Linear or type(weight).__name__ != "Float8Tensor":
        return False
    activation = getattr(weight, "act_quant_kwargs", None)
    block = list(getattr(weight, "block_size", []))
    return (activation is not None and block == [1, weight.shape[-1]] and weight.qdata.dtype == torch.float8_e4m3fn
            and type(activation.granularity).__name__ == "PerRow" and activation.hp_value_lb is None
            and activation.hp_value_ub is None and activation.float8_dtype == torch.float8_e4m3fn
            and weight.dtype == torch.bfloat16)


# diffusers' names for them: attention outputs (FLUX.1's and FLUX.2's single blocks take attention
# beside the MLP: `proj_out`, `attn.to_out`), and the feed-forwards' second layers (FLUX.1, SD3,
# Wan `ffn.net.2`, Qwen-Image `img_mlp`/`txt_mlp`, FLUX.2's SwiGLU `linear_out`)
OUTPUT_PROJECTIONS = ("proj_out", "to_out.0", "to_add_out", "attn.to_out", "ff.net.2", "ff_context.net.2",
                      "ffn.net.2", "img_mlp.net.2", "txt_mlp.net.2", "ff.linear_out", "ff_context.linear_out")


def use_float8_rows(module: nn.Module, names: tuple[str, ...] | None = OUTPUT_PROJECTIONS) -> int:
    """Switch the linear layers of `module` that `fp8` quantized and whose names end with
    one of `names` (None: every such layer) to `Float8RowsLinear` where the kernel runs on
    their device; returns how many were switched."""
    switched = 0
    for name, layer in module.named_modules():
        if (names is None or name.endswith(names)) and _takes_float8_rows(layer) \
                and float8_runs_on(layer.weight.qdata.device) and rows_kernel() is not None:
            layer.__class__ = Float8RowsLinear
            switched += 1
    if switched:
        logger.info("%s: %d float8 linear layers scale their activations in one pass", type(module).__name__, switched)
    return switched
