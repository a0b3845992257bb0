"""Attention with float8 operands on Hopper, in a Triton kernel of our own (not yet served:
`scripts/fp8_attention_probe.py` measures its speed and error against bf16 SDPA).

cuDNN's float8 attention on Hopper writes its output in float8 (1 part in 16), which put
FLUX.1's attention at 26 times bf16's error. Here only the two matmuls' operands are float8;
the softmax, the running sums and the output stay fp32 and the output is written in bf16:
- q and k: one scale per head and block of tokens (the kernel's tiles), so one tile's
  product takes one factor; k first loses its mean over the tokens per head and channel,
  which changes no query's softmax (q . mean(k) is the same for every key) and narrows the
  range the scales must cover;
- v: one scale per head and channel, applied to the output once;
- the probabilities, in [0, 1], scaled by 448 into float8's normal range for P @ V; the row
  sums are taken before that rounding.
With `pv_float8=False` only q k^T takes float8 operands and P @ V stays bf16 (half the
matmul work at float8's rate, float8's error on the logits only).

`quantize_qkv` prepares the operands in torch ops (Inductor fuses them under compile):
q and k as [B, H, S, D], v transposed to [B, H, D, S] (float8 matmuls read both operands
along the reduced dimension; bf16 v stays [B, H, S, D]), the tokens padded to whole blocks. `attention_fp8` runs the
kernel on them and returns [B, S, H, D] as diffusers' processors pass it.
"""

import math
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from .float8_rounding import interpreting

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = 448.0


@dataclass(frozen=True)
class Float8Operands:
    q: torch.Tensor  # [B, H, S padded, D] float8
    k: torch.Tensor  # [B, H, S padded, D] float8, less its mean over the tokens
    v: torch.Tensor  # [B, H, D, S padded] float8, or [B, H, S padded, D] bf16
    q_scales: torch.Tensor  # [B, H, S padded / block_m] fp32
    k_scales: torch.Tensor  # [B, H, S padded / block_n] fp32
    v_scales: torch.Tensor | None  # [B, H, D] fp32 (float8 v)
    tokens: int  # S before padding
    block_m: int
    block_n: int


def _per_block(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, S, D] (S whole blocks) as float8 with one scale per head and block of tokens."""
    b, h, s, d = x.shape
    blocks = x.float().view(b, h, s // block, block, d)
    scales = blocks.abs().amax(dim=(3, 4)).clamp(min=1e-30) / FLOAT8_MAX
    return (blocks / scales[..., None, None]).to(FLOAT8).view(b, h, s, d), scales


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 128,
                 block_n: int = 128, pv_float8: bool = True) -> Float8Operands:
    """The kernel's operands from q, k, v of [B, S, H, D] (any strides)."""
    tokens = q.shape[1]
    padded = math.lcm(block_m, block_n) * math.ceil(tokens / math.lcm(block_m, block_n))
    # [B, H, S padded, D], contiguous (F.pad of nothing returns the transposed view itself)
    pad = lambda x: F.pad(x.transpose(1, 2), (0, 0, 0, padded - tokens)).contiguous()  # noqa: E731
    q8, q_scales = _per_block(pad(q), block_m)
    k8, k_scales = _per_block(pad(k - k.float().mean(dim=1, keepdim=True).to(k.dtype)), block_n)
    if not pv_float8:
        return Float8Operands(q8, k8, pad(v).to(torch.bfloat16), q_scales, k_scales, None, tokens, block_m, block_n)
    v_scales = v.float().abs().amax(dim=1).clamp(min=1e-30) / FLOAT8_MAX  # [B, H, D]
    v8 = (pad(v).float() / v_scales[:, :, None, :]).to(FLOAT8).transpose(2, 3).contiguous()
    return Float8Operands(q8, k8, v8, q_scales, k_scales, v_scales, tokens, block_m, block_n)


def attention_fp8(operands: Float8Operands, scale: float | None = None, num_warps: int = 8,
                  num_stages: int = 3) -> torch.Tensor:
    """softmax(q k^T * scale) v for the prepared operands, as [B, S, H, D] bf16."""
    o = operands
    batch, heads, padded, dim = o.q.shape
    scale = 1 / math.sqrt(dim) if scale is None else scale
    out = torch.empty(batch, o.tokens, heads, dim, device=o.q.device, dtype=torch.bfloat16)
    grid = (padded // o.block_m, batch * heads)
    pv_float8 = o.v_scales is not None
    _kernel()[grid](o.q, o.k, o.v, o.q_scales, o.k_scales, o.v_scales if pv_float8 else o.q_scales, out, o.tokens,
                    padded, heads, scale * math.log2(math.e), *out.stride()[:3], DIM=dim, BLOCK_M=o.block_m,
                    BLOCK_N=o.block_n, EVEN=padded == o.tokens, PV_FLOAT8=pv_float8, IEEE=interpreting(),
                    num_warps=num_warps, num_stages=num_stages)
    return out


@cache
def _kernel():
    global _add, _larger  # (module globals, where the kernel's body finds them)
    import triton
    import triton.language as tl

    @triton.jit
    def _add(a, b):  # tl.sum and tl.max are jit functions of Triton's own, which its interpreter cannot call
        return a + b

    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def attention_fp8_kernel(q_ptr, k_ptr, v_ptr, q_scales_ptr, k_scales_ptr, v_scales_ptr, out_ptr, tokens,
                             padded, heads, scale_log2, stride_b, stride_s, stride_h, DIM: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                             PV_FLOAT8: tl.constexpr, IEEE: tl.constexpr):
        block, bh = tl.program_id(0), tl.program_id(1)
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols, dims = tl.arange(0, BLOCK_N), tl.arange(0, DIM)
        base = bh.to(tl.int64) * padded * DIM  # (q, k and v: one head's padded * DIM values)
        q = tl.load(q_ptr + base + rows[:, None] * DIM + dims[None, :])
        q_scale = tl.load(q_scales_ptr + bh * (padded // BLOCK_M) + block) * scale_log2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, DIM], 0.0, tl.float32)
        for j in range(0, padded // BLOCK_N):
            keys = j * BLOCK_N + cols
            k = tl.load(k_ptr + base + keys[None, :] * DIM + dims[:, None])  # [DIM, BLOCK_N], DIM contiguous
            qk = tl.dot(q, k) * (q_scale * tl.load(k_scales_ptr + bh * (padded // BLOCK_N) + j))
            if not EVEN:  # the padding's keys take no weight
                qk = tl.where(keys[None, :] < tokens, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, _larger))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.reduce(p, 1, _add)
            if PV_FLOAT8:  # [BLOCK_N, DIM], keys contiguous
                v = tl.load(v_ptr + base + dims[None, :] * padded + keys[:, None])
                acc = tl.dot((p * 448.0).to(tl.float8e4nv), v, acc * alpha[:, None])
            elif IEEE:  # (Triton's CPU interpreter, whose bf16 dot is wrong: the same bf16 values, fp32 products)
                v = tl.load(v_ptr + base + keys[:, None] * DIM + dims[None, :]).to(tl.float32)
                acc = tl.dot(p.to(tl.bfloat16).to(tl.float32), v, acc * alpha[:, None], input_precision="ieee")
            else:
                v = tl.load(v_ptr + base + keys[:, None] * DIM + dims[None, :])
                acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m_i = m_new
        out = acc / l_i[:, None]
        if PV_FLOAT8:
            out = out * (tl.load(v_scales_ptr + bh * DIM + dims) / 448.0)[None, :]
        b, h = bh // heads, bh % heads
        pointers = out_ptr + b.to(tl.int64) * stride_b + h * stride_h + rows[:, None] * stride_s + dims[None, :]
        tl.store(pointers, out.to(tl.bfloat16), mask=rows[:, None] < tokens)

    return attention_fp8_kernel
