"""The float8 attention kernel (`engine/float8_attention.py`) under Triton's CPU interpreter,
against float64 attention: on its own float8 operands (dequantized) it is exact up to its
rounding of the probabilities; on the bf16 inputs its error is float8's."""

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("interpreted")


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def attention64(q, k, v) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float64, for [B, S, H, D] tensors."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (p @ v).transpose(1, 2)


def dequantized(operands):
    """The operands the kernel reads, as [B, S, H, D] float64 (padding cut off)."""
    o, tokens = operands, operands.tokens
    b, h, padded, d = o.q.shape

    def per_block(x8, scales, block):
        return (x8.double().view(b, h, padded // block, block, d) * scales.double()[..., None, None]).view(b, h, -1, d)

    q = per_block(o.q, o.q_scales, o.block_m)
    k = per_block(o.k, o.k_scales, o.block_n)
    v = o.v.double() if o.v_scales is None else o.v.double().transpose(2, 3) * o.v_scales.double()[:, :, None, :]
    return tuple(x[:, :, :tokens].transpose(1, 2) for x in (q, k, v))


def inputs(tokens: int, k_offset: float = 0.0, batch: int = 1, heads: int = 2, dim: int = 16):
    g = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(batch, tokens, heads, dim, generator=g) for _ in range(3))
    return q.bfloat16(), (k + k_offset).bfloat16(), v.bfloat16()


def relative(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("tokens", [64, 40])  # whole blocks (no masks), and padded
def test_float8_attention_is_exact_on_its_own_operands(tokens):
    from loraswap.engine.float8_attention import attention_fp8, quantize_qkv

    q, k, v = inputs(tokens, batch=2, heads=1)
    for pv_float8, bound in ((False, 0.006), (True, 0.06)):  # bf16 P, or P in float8 (1 part in 16)
        operands = quantize_qkv(q, k, v, block_m=16, block_n=32, pv_float8=pv_float8)
        out = attention_fp8(operands)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        error = relative(out, attention64(*dequantized(operands)))
        assert error < bound, (pv_float8, error)


def test_float8_attention_error_is_float8s_and_a_shift_of_k_changes_nothing():
    """k less its mean over the tokens: a large shared offset in k (which changes no query's
    softmax) costs no accuracy, where one scale over it would lose k's detail."""
    from loraswap.engine.float8_attention import attention_fp8, quantize_qkv

    errors = {}
    for offset in (0.0, 20.0):
        q, k, v = inputs(40, k_offset=offset)
        reference = attention64(q, k, v)
        errors[offset] = {pv: relative(attention_fp8(quantize_qkv(q, k, v, 16, 32, pv_float8=pv)), reference)
                          for pv in (False, True)}
    assert errors[0.0][False] < 0.06 and errors[0.0][True] < 0.1, errors
    for pv in (False, True):
        assert errors[20.0][pv] < 1.25 * errors[0.0][pv], errors
