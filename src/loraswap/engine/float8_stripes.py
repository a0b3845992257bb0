"""The float8 re-quantization by column stripes, for the large weights: two launches, each
program a stripe of `BLOCK_N` columns walking down `ROW_TILES` tiles of `BLOCK_M` rows.

The per-row kernel (`float8_kernels.py`) holds whole rows, so every program reads all of
`down` ([rank, columns]): at rank 32 and 16 rows a program, 4 bytes of it from the L2 cache
for every byte of weight, twice. On FLUX.2's large weights that traffic, not the memory's,
bounds it. Here a program's `down` columns stay in its L1 cache while it walks down the
rows; each row's largest |W| is gathered across stripes by an atomic max (launch one), and
the second launch writes the rows as float8 by the same arithmetic as the per-row kernel,
so both write the same values. DoRA's row norms are gathered the same way (atomic adds).
"""

from functools import cache
from typing import NamedTuple

import torch

from .float8_rounding import interpreting
from .float8_tiles import row_functions
from .kernels import triton_cdiv


class StripeTiles(NamedTuple):
    """The column-stripe kernel's tiles."""

    rows: int  # rows a tile
    columns: int  # columns a stripe
    row_tiles: int  # tiles a stripe walks
    stages: int  # most pipelining stages


STRIPE_TILES = StripeTiles(64, 128, 8, 3)
STRIPE_NUM_WARPS = 4
STRIPES_FROM: int | None = None  # weights of at least this many values go by stripes


# the Triton functions the kernel calls (and `tl`), set when it is built
_row_tile = _inside = _dora_factor = _larger = _add = _reciprocal = _divide = round_to_float8 = tl = None


@cache
def _stripes_kernel():
    """The two-launch kernel, or None without Triton (built once)."""
    functions = row_functions()
    if functions is None:
        return None
    globals().update(functions)  # where Triton looks up the functions the kernel calls
    import triton

    @triton.jit(do_not_specialize=["M", "P", "Q", "alpha", "blend"])
    def requantize_stripes(out_ptr, scale_out_ptr, largest_ptr, squares_ptr, p_ptr, s_ptr, b_ptr, a_ptr, b2_ptr,
                           a2_ptr, alphas_ptr, m_ptr, M, N, K, P, Q, alpha, blend, PASS: tl.constexpr,
                           RECIPROCAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr, ROW_TILES: tl.constexpr,
                           STAGES: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr, BLENDED: tl.constexpr,
                           KIND: tl.constexpr, DORA: tl.constexpr, EVEN: tl.constexpr):
        # PASS 0: each row's largest |W| (and DoRA's sum of squares) over this stripe, into
        # `largest` by atomic max; PASS 1: the new scales (the first stripe stores them) and
        # the stripe's values as float8
        n0 = tl.program_id(0) * BLOCK_N
        first = tl.program_id(1) * BLOCK_M * ROW_TILES
        for t in tl.range(0, ROW_TILES, num_stages=STAGES):
            rm = first + t * BLOCK_M + tl.arange(0, BLOCK_M)
            in_m = _inside(rm, M, EVEN)
            rows = rm.to(tl.int64)
            scale = tl.load(s_ptr + rows, mask=in_m, other=1.0)[:, None]
            w, offsets, mask = _row_tile(p_ptr, b_ptr, a_ptr, b2_ptr, a2_ptr, alphas_ptr, rows, in_m, scale, n0, N, K,
                                         P, Q, alpha, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BLENDED, KIND, K_BLOCKS,
                                         EVEN)
            if PASS == 0:
                w = tl.where(mask, w, 0.0)
                tl.atomic_max(largest_ptr + rows, tl.reduce(tl.abs(w), 1, _larger), mask=in_m, sem="relaxed")
                if DORA > 0:
                    tl.atomic_add(squares_ptr + rows, tl.reduce(w * w, 1, _add), mask=in_m, sem="relaxed")
            else:
                largest = tl.load(largest_ptr + rows, mask=in_m, other=0.0)
                if DORA > 0:  # (as the per-row kernel: the largest |V| times |f|)
                    factor = _dora_factor(tl.load(squares_ptr + rows, mask=in_m, other=1.0), m_ptr, rows, in_m, blend,
                                          DORA)
                    largest = largest * tl.abs(factor)
                    w = w * factor[:, None]
                if EMULATE:
                    new_scale = tl.math.div_rn(largest, tl.full(largest.shape, 448.0, tl.float32))
                else:
                    new_scale = largest * RECIPROCAL
                if tl.program_id(0) == 0:
                    tl.store(scale_out_ptr + rows, new_scale, mask=in_m)
                new_scale = new_scale[:, None]
                q = round_to_float8(_divide(w, new_scale, _reciprocal(new_scale), EMULATE), EMULATE)
                tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)

    return requantize_stripes


def stripe_tiles(m: int, n: int, kind: str) -> StripeTiles | None:
    """The column-stripe kernel's tiles for an m x n weight and this change, or None where
    the per-row kernel writes it: weights under `STRIPES_FROM` values, and LoKr (no `down`)."""
    if STRIPES_FROM is None or m * n < STRIPES_FROM or kind == "kronecker":
        return None
    return StripeTiles(16, 64, 2, 2) if interpreting() else STRIPE_TILES


def requantize_stripes(qdata: torch.Tensor, scale: torch.Tensor, operands: tuple, options: dict,
                       tiles: StripeTiles, dora: bool) -> None:
    """The two launches into `qdata` and `scale`: `operands` and `options` are the per-row
    kernel's (`float8_kernels._requantize_rows`) past its outputs; `dora`: whether DoRA's row
    norms are gathered too."""
    m, n = qdata.shape
    gathered = torch.zeros(2 * m if dora else m, device=qdata.device, dtype=torch.float32)
    grid = (triton_cdiv(n, tiles.columns), triton_cdiv(m, tiles.rows * tiles.row_tiles))
    for step in (0, 1):
        _stripes_kernel()[grid](qdata, scale, gathered, gathered[m:] if dora else gathered, *operands, PASS=step,
                                ROW_TILES=tiles.row_tiles, num_warps=STRIPE_NUM_WARPS, **options)
