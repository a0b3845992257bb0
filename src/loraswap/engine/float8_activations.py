"""Row-wise float8 activations in one pass: the input of a float8 linear layer (`--quantize
fp8`) scaled by a Triton kernel of our own instead of torchao's torch ops.

torchao quantizes each activation row as `x / s` with `s = amax(|row|) / 448` (the division
in the activation's dtype), through ops that Inductor fuses into the kernel producing the
activation: one pass reads it for the largest value, another reads it again to scale it,
well under the GPU's bandwidth at FLUX's rows of 3,072 to 15,360 values. torchao's own
one-pass kernel (`mslk`'s `quantize_fp8_row`) is not published on PyPI for this CUDA. Here
one program scales a row: it holds the whole row in registers (up to `WHOLE_ROW_VALUES`),
finds its largest value, scales, rounds and stores it, reading it once; a longer row is
read twice in blocks, the second time from the L2 cache. Its output is torchao's bitwise
(same scale, same rounding), but for an all-zero row: torchao divides 0 by 0 there and
writes NaN, the kernel writes zeros. The looping kernel alone scaled FLUX.1's activations
3.5 to 13 times faster than Inductor's fused torchao ops on an H200
(bench/results/float8-h200/activation-kernel.json).

The kernel can also apply a tanh-GELU as it reads, and read a row's end from a second
tensor: `float8_producers` uses both to take over the op that produced the activation.

It is an opaque op to compiled graphs, so it pays only where Inductor cannot fuse better:
the output projections (`OUTPUT_PROJECTIONS`: attention outputs and the feed-forward's
second layer), whose input comes from attention or an activation function and feeds no
other layer. A layer fed by a norm, or sharing its input with others (q, k and v), keeps
torchao's scaling, which Inductor fuses into the norm's kernel and computes once for all of
them; the kernel on every layer made a FLUX.1 step slower (96.3 ms against 92.8), on the
output projections faster (90.0 against 92.4; bench/results/float8-h200/).

`use_float8_rows(module)` switches those layers to this path; their weights stay torchao's
`Float8Tensor`, so the swap re-quantizes them in place as before, and the matmul is the
`torch._scaled_mm` torchao calls.
"""

import logging
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from .float8_rounding import float8_rounding, float8_runs_on
from .kernels import triton_cdiv

logger = logging.getLogger(__name__)

BLOCK = 1024  # values of a row the looping kernel loads at a time (best at every FLUX.1 shape on an H200)
NUM_WARPS = 8
WHOLE_ROW_VALUES = 32768  # the most values (a row, its tail, each padded to a power of two) one program holds
INTERPRETED_ROWS = 64  # rows a program scales under Triton's interpreter, where each program costs


@cache
def _kernels() -> dict | None:
    """The Triton kernels (built once, on first use), or None without Triton: `whole` holds a
    row (and its tail) in registers and reads it once; `loop` reads a longer row twice, in
    blocks, the second time from the L2 cache."""
    triton = _helpers()
    return None if triton is None else {"whole": _whole_row_kernel(triton), "loop": _loop_kernel(triton)}


def _helpers():
    """Triton (None without it), with the functions the kernels call made module globals,
    where Triton looks them up."""
    global round_to_float8, _row_max, _scale_of, _scaled, _to_bfloat16, _activation, libdevice, tl
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
    except ImportError:
        return None
    round_to_float8 = float8_rounding()

    @triton.jit
    def _to_bfloat16(value):
        """fp32 values rounded to bf16's precision (nearest, ties to even), kept in fp32."""
        bits = value.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)

    @triton.jit
    def _activation(value, GELU: tl.constexpr, EMULATE: tl.constexpr):
        """The loaded bf16 values in fp32; with GELU, tanh-GELU's bf16 output, computed op for
        op as Inductor compiles torch's (libdevice's tanh; the interpreter has none)."""
        value = value.to(tl.float32)
        if GELU:
            inner = 0.7978845608028654 * (value + 0.044715 * (value * value * value))
            if EMULATE:
                tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
            else:
                tanh = libdevice.tanh(inner)
            value = _to_bfloat16(0.5 * value * (1.0 + tanh))
        return value

    @triton.jit
    def _row_max(magnitudes):
        """Each row's largest value, NaN where the row has one (as torch's amax). Triton's own
        max, then NaN put back: the interpreter runs it in numpy, which may drop NaN."""
        amax = tl.reduce(magnitudes, 1, tl.standard._elementwise_max)
        nan_seen = tl.reduce((magnitudes != magnitudes).to(tl.float32), 1, tl.standard._elementwise_max)
        return tl.where(nan_seen > 0, float("nan"), amax)

    @triton.jit
    def _scale_of(amax):
        return _to_bfloat16(tl.math.div_rn(amax, 448.0))  # torchao divides in the activation's dtype, bf16

    @triton.jit
    def _scaled(value, divisor, EMULATE: tl.constexpr):
        return round_to_float8(tl.math.div_rn(value, divisor), EMULATE)

    return triton


def _whole_row_kernel(triton):
    @triton.jit(do_not_specialize=["M", "stride", "tail_stride"])
    def quantize_rows_whole(x_ptr, t_ptr, q_ptr, s_ptr, M, K, stride, T, tail_stride, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, GELU: tl.constexpr,
                            TAIL_GELU: tl.constexpr, EMULATE: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        in_m = rows[:, None] < M
        cols = tl.arange(0, BLOCK)[None, :]
        head_mask = in_m & (cols < K)
        head = _activation(tl.load(x_ptr + rows[:, None] * stride + cols, mask=head_mask, other=0.0), GELU, EMULATE)
        amax = _row_max(tl.abs(head))
        if TAIL_BLOCK > 0:  # the row goes on in another tensor (FLUX.1's single block: the MLP after attention)
            tail_cols = tl.arange(0, TAIL_BLOCK)[None, :]
            tail_mask = in_m & (tail_cols < T)
            tail = _activation(tl.load(t_ptr + rows[:, None] * tail_stride + tail_cols, mask=tail_mask, other=0.0),
                               TAIL_GELU, EMULATE)
            amax = tl.maximum(amax, _row_max(tl.abs(tail)), propagate_nan=tl.PropagateNan.ALL)
        scale = _scale_of(amax)
        tl.store(s_ptr + rows, scale, mask=rows < M)
        divisor = tl.where(scale == 0.0, 1.0, scale)[:, None]  # an all-zero row: zeros, not 0 / 0
        target = q_ptr + rows[:, None] * (K + T)
        tl.store(target + cols, _scaled(head, divisor, EMULATE).to(q_ptr.dtype.element_ty), mask=head_mask)
        if TAIL_BLOCK > 0:
            tl.store(target + K + tail_cols, _scaled(tail, divisor, EMULATE).to(q_ptr.dtype.element_ty),
                     mask=tail_mask)

    return quantize_rows_whole


def _loop_kernel(triton):
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
            value = _activation(tl.load(source + at, mask=in_m[:, None] & (at < K), other=0.0), GELU, EMULATE)
            largest = tl.maximum(largest, tl.abs(value), propagate_nan=tl.PropagateNan.ALL)
        scale = _scale_of(_row_max(largest))
        tl.store(s_ptr + rows, scale, mask=in_m)
        divisor = tl.where(scale == 0.0, 1.0, scale)[:, None]
        for start in range(0, K, BLOCK):
            at = start + cols[None, :]
            mask = in_m[:, None] & (at < K)
            value = _activation(tl.load(source + at, mask=mask, other=0.0), GELU, EMULATE)
            tl.store(target + at, _scaled(value, divisor, EMULATE).to(q_ptr.dtype.element_ty), mask=mask)

    return quantize_rows


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def whole_row_warps(values: int) -> int:
    """Warps (a power of two, 4 to 16) for a program holding `values` values: 64 or fewer a thread."""
    return min(max(1 << max(values // (32 * 64), 1).bit_length() - 1, 4), 16)


def _gelu_if(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    return F.gelu(x, approximate="tanh") if gelu else x


# an opaque custom op: compiled graphs call it as it is (Inductor's own launch of a user's
# Triton kernel, `torch.library.triton_op`, failed on torch 2.11 with Triton 3.6)
@torch.library.custom_op("loraswap::float8_rows", mutates_args=())
def float8_rows(x: torch.Tensor, gelu: bool = False, tail: torch.Tensor | None = None,
                tail_gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D bf16 activation with rows of unit stride as float8 e4m3 values and one fp32
    scale per row ([rows, 1]), as torchao's `Float8Tensor.from_hp(x, PerRow())`; with `gelu`,
    of tanh-GELU(x) (rounded to bf16 first, as torch's GELU returns it). With `tail`, each
    row of x goes on with the same row of `tail` (GELU'd with `tail_gelu`), as if the two
    were concatenated: the concatenation is never written in bf16."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    tail = tail if tail is None or tail.stride(-1) == 1 else tail.contiguous()
    rows, k = x.shape
    t = 0 if tail is None else tail.shape[1]
    quantized = torch.empty((rows, k + t), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if not rows:
        return quantized, scale
    kernels, emulate = _kernels(), not x.is_cuda  # CPU tensors: Triton's interpreter
    per_program = INTERPRETED_ROWS if emulate else 1
    block, tail_block = _power_of_two(k), _power_of_two(t) if t else 0
    if block + tail_block <= WHOLE_ROW_VALUES:
        kernels["whole"][(triton_cdiv(rows, per_program),)](
            x, x if tail is None else tail, quantized, scale, rows, k, x.stride(0), t, 0 if tail is None else
            tail.stride(0), ROWS=per_program, BLOCK=block, TAIL_BLOCK=tail_block, GELU=gelu, TAIL_GELU=tail_gelu,
            EMULATE=emulate, num_warps=whole_row_warps(block + tail_block))
        return quantized, scale
    if tail is not None:  # too long to hold: written out, and read twice
        x, gelu = torch.cat([_gelu_if(x, gelu), _gelu_if(tail, tail_gelu)], dim=1), False
    kernels["loop"][(triton_cdiv(rows, per_program),)](
        x, quantized, scale, rows, k + t, x.stride(0), ROWS=per_program, BLOCK=min(BLOCK, _power_of_two(k + t)),
        EMULATE=emulate, GELU=gelu, num_warps=NUM_WARPS)
    return quantized, scale


@float8_rows.register_fake
def _(x: torch.Tensor, gelu: bool = False, tail: torch.Tensor | None = None,
      tail_gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    columns = x.shape[1] + (0 if tail is None else tail.shape[1])
    return (torch.empty((x.shape[0], columns), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


class Float8RowsLinear(nn.Linear):
    """A linear layer with a torchao `Float8Tensor` weight (row-wise scales), whose input is
    quantized by `float8_rows` and multiplied as torchao does (`torch._scaled_mm`, the
    weight's own fast-accumulation setting). Other activation dtypes take torchao's path."""

    def forward(self, x: torch.Tensor, gelu: bool = False, gelu_tail: torch.Tensor | None = None) -> torch.Tensor:
        """The layer of x (of tanh-GELU(x) with `gelu`); with `gelu_tail`, of x's rows
        continued by tanh-GELU(gelu_tail)'s (`float8_producers` passes these)."""
        if x.dtype != torch.bfloat16:
            x = _gelu_if(x, gelu)
            return super().forward(x if gelu_tail is None else torch.cat([x, _gelu_if(gelu_tail, True)], dim=-1))
        weight = self.weight
        tail = None if gelu_tail is None else gelu_tail.reshape(-1, gelu_tail.shape[-1])
        quantized, scale = torch.ops.loraswap.float8_rows(x.reshape(-1, x.shape[-1]), gelu, tail, tail is not None)
        out = torch._scaled_mm(quantized, weight.qdata.t(), scale_a=scale, scale_b=weight.scale.t(), bias=self.bias,
                               out_dtype=x.dtype, use_fast_accum=weight.mm_config.use_fast_accum)
        return out.reshape(*x.shape[:-1], out.shape[-1])


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


# diffusers' names for them (FLUX.1, FLUX.2's double blocks, SD3, Qwen-Image, Wan attention)
OUTPUT_PROJECTIONS = ("proj_out", "to_out.0", "to_add_out", "ff.net.2", "ff_context.net.2")


def use_float8_rows(module: nn.Module, names: tuple[str, ...] | None = OUTPUT_PROJECTIONS) -> int:
    """Switch the linear layers of `module` that `fp8` quantized and whose names end with
    one of `names` (None: every such layer) to `Float8RowsLinear` where the kernel runs on
    their device; returns how many were switched."""
    switched = 0
    for name, layer in module.named_modules():
        if (names is None or name.endswith(names)) and _takes_float8_rows(layer) \
                and float8_runs_on(layer.weight.qdata.device) and _kernels() is not None:
            layer.__class__ = Float8RowsLinear
            switched += 1
    if switched:
        logger.info("%s: %d float8 linear layers scale their activations in one pass", type(module).__name__, switched)
    return switched
