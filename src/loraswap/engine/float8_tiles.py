"""The Triton functions both float8 swap kernels call (the per-row one in `float8_kernels.py`,
the column-stripe one in `float8_stripes.py`): the tiles of W = dequantize(P) + alpha * B @ A
for each kind of change, the division by the new scale and the rounding to float8, and the
operands they share."""

from dataclasses import dataclass
from functools import cache

import torch

from . import kernels
from .float8_rounding import float8_rounding

FLOAT8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# CUDA's `stats / 448` multiplies by the fp32 reciprocal of 448: the per-row kernel does the same
RECIPROCAL_FLOAT8_MAX = float(torch.tensor(1 / FLOAT8_MAX, dtype=torch.float32))


@dataclass(frozen=True)
class DoraRows:
    """DoRA's rescaling of each output row after the change (`kinds.rescale_dora`): the
    magnitude (one per row), the request's weight, and whose convention (PEFT or LyCORIS)."""

    magnitude: torch.Tensor
    blend: float
    peft: bool


ROW_CHANGES = ("low_rank", "hadamard", "kronecker")  # the per-row kernel's changes, by its KIND


@cache
def _float8_functions() -> bool:
    """Define the Triton functions the kernels call as this module's globals (where Triton
    looks up the functions they call; the tiles of B @ A are `kernels.py`'s); False without
    Triton."""
    global _blended_tile, _block_product, _larger, _add, _reciprocal, _divide, _dora_factor, _inside
    global round_to_float8, tl
    if not kernels.tile_functions():
        return False
    import triton
    import triton.language as tl

    _blended_tile, _block_product, _inside = kernels._blended_tile, kernels._block_product, kernels._inside
    round_to_float8 = float8_rounding()

    @triton.jit
    def _larger(a, b):  # tl.max is a jit function of Triton's own, which its interpreter cannot call
        return tl.maximum(a, b)

    @triton.jit
    def _reciprocal(new_scale):
        # 1 / new_scale rounded to nearest, as Markstein's sequence needs it
        return tl.math.div_rn(tl.full(new_scale.shape, 1.0, tl.float32), new_scale)

    @triton.jit
    def _divide(w, new_scale, reciprocal, EMULATE: tl.constexpr):
        # w / new_scale ([rows, 1]) as IEEE division (torch's tensor / tensor): under the
        # interpreter by it (its fma is not fused), on a GPU by Markstein's sequence on the
        # reciprocal (`_reciprocal`)
        if EMULATE:
            return tl.math.div_rn(w, new_scale)
        q = w * reciprocal
        return tl.fma(tl.fma(-q, new_scale, w), reciprocal, q)

    @triton.jit
    def _add(a, b):  # (as `_larger`)
        return a + b

    @triton.jit
    def _dora_factor(squares, m_ptr, rows, in_m, blend, DORA: tl.constexpr):
        # each row's DoRA factor from its sum of squares (`kinds.dora_factors`): PEFT m / norm;
        # LyCORIS blend (m / (norm + eps) - 1) + 1
        norm = tl.math.sqrt_rn(squares)
        magnitude = tl.load(m_ptr + rows, mask=in_m, other=1.0).to(tl.float32)
        if DORA == 1:
            return tl.math.div_rn(magnitude, norm)
        return blend * (tl.math.div_rn(magnitude, norm + 1.1920928955078125e-07) - 1.0) + 1.0  # fp32 eps

    return True


@cache
def _row_functions() -> bool:
    """The tiles of W for the float8 kernels (as `_float8_functions`), with the rank unrolled."""
    global _product, _kron, _row_tile
    if not _float8_functions():
        return False
    import triton

    @triton.jit
    def _product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLENDED: tl.constexpr,
                 K_BLOCKS: tl.constexpr, EVEN: tl.constexpr):
        # the tile (rows, rn) of B @ A in fp32. K_BLOCKS > 0: that many blocks of ranks unrolled
        # (covering K), no loop, so that the loop over the row's tiles can be pipelined
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        if K_BLOCKS > 0:
            for block in tl.static_range(K_BLOCKS):
                acc += _block_product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, block * BLOCK_K,
                                      BLOCK_K, IEEE, BLENDED, EVEN)
        else:
            for k0 in range(0, K, BLOCK_K):
                acc += _block_product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, k0, BLOCK_K, IEEE,
                                      BLENDED, EVEN)
        return acc

    @triton.jit
    def _kron(w1_ptr, w2_ptr, rows, rn, mask, N, P, Q):
        # LoKr: kron(w1, w2) at (rows, rn), w1 [a, N / Q] and w2 [P, Q] whole, in fp32
        first = tl.load(w1_ptr + (rows // P)[:, None] * (N // Q) + (rn // Q)[None, :], mask=mask, other=0.0)
        return first * tl.load(w2_ptr + (rows % P)[:, None] * Q + (rn % Q)[None, :], mask=mask, other=0.0)

    @triton.jit
    def _row_tile(p_ptr, b_ptr, a_ptr, b2_ptr, a2_ptr, alphas_ptr, rows, in_m, scale, n0, N, K, P, Q, alpha,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                  BLENDED: tl.constexpr, KIND: tl.constexpr, K_BLOCKS: tl.constexpr, EVEN: tl.constexpr):
        # the tile of W at columns n0.. of these rows in fp32, its offsets and mask. The change:
        # KIND 0 B @ A; 1 (LoHa) (B @ A) * (B2 @ A2); 2 (LoKr) kron(B, A), A of P x Q
        rn = n0 + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
        in_n = _inside(rn, N, EVEN)
        offsets, mask = rows[:, None] * N + rn[None, :], in_m[:, None] & in_n[None, :]
        if KIND == 2:
            acc = _kron(b_ptr, a_ptr, rows, rn, mask, N, P, Q)
        else:
            acc = _product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE,
                           BLENDED, K_BLOCKS, EVEN)
        if KIND == 1:
            acc = acc * _product(b2_ptr, a2_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                 IEEE, False, K_BLOCKS, EVEN)
        return tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale + acc * alpha, offsets, mask

    return True


KERNEL_FUNCTIONS = ("_row_tile", "_inside", "_dora_factor", "_larger", "_add", "_reciprocal", "_divide",
                    "_blended_tile", "round_to_float8", "tl")


def row_functions() -> dict | None:
    """The Triton functions (and `tl`) a float8 kernel calls, by name, for its module's
    globals (where Triton looks them up); None without Triton."""
    if not _row_functions():
        return None
    return {name: globals()[name] for name in KERNEL_FUNCTIONS}
