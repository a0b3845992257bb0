"""What bounds the per-row float8 re-quantization kernel (`float8_kernels.requantize_into`) at
FLUX.2 [dev]'s largest weights, and a kernel that reads the up-projection's columns once
(median times, `triton.testing.do_bench`, rate at 3 bytes a weight: read twice, written once):

- `ranks`: the served kernel at rank 8, 16, 32 and 64. Each program holds 16 or 32 whole rows
  and reads all of `down` ([rank, columns], from L2) twice, 2 x rank / rows bytes of it for
  every byte of weight; if that traffic bounds it, time grows with the rank;
- `product`: a copy of the served kernel (`float8_kernel_variants.rows_kernel`) with and
  without the product B @ A (and its loads of `down`);
- `stripes`: two launches over column stripes: each program holds a tile of `down` columns in
  registers and walks down the rows, taking each row's largest |W| by an atomic max (launch
  one), then writing the float8 rows (launch two), at several tiles; bitwise against the
  served kernel's output.

    PYTHONPATH=src python scripts/float8_swap_bounds.py [--runs ranks,product,stripes] [--out OUT.json]
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from loraswap.engine import float8_kernels

sys.path.insert(0, str(Path(__file__).parent))  # (the kernel's copy is float8_kernel_variants.py's)
import float8_kernel_variants as variants  # noqa: E402
from float8_kernel_variants import OTHER_SHAPES, RECIPROCAL_448, SHAPES, rows_kernel, timed  # noqa: E402


def weight(m: int, n: int, rank: int) -> tuple:
    """An output buffer for a float8 weight of m x n, its pristine copy and scale, and rank-r factors."""
    _, pristine, scale, up, down, _ = variants.weight(m, n, rank)
    return torch.empty_like(pristine), pristine, scale, up, down


@triton.jit
def stripes_kernel(out_ptr, new_s_ptr, stats_ptr, p_ptr, s_ptr, b_ptr, a_ptr, M, N, K, alpha, PASS: tl.constexpr,
                   RECIPROCAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   ROW_TILES: tl.constexpr, STAGES: tl.constexpr):
    """A stripe of BN columns over ROW_TILES tiles of BM rows: `down`'s columns loaded once."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    down = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :])
    first = tl.program_id(1) * BM * ROW_TILES
    for t in tl.range(0, ROW_TILES, num_stages=STAGES):
        rows = (first + t * BM + tl.arange(0, BM)).to(tl.int64)
        offsets = rows[:, None] * N + cols[None, :]
        up = tl.load(b_ptr + rows[:, None] * K + ks[None, :])
        w = tl.load(p_ptr + offsets).to(tl.float32) * tl.load(s_ptr + rows)[:, None] + tl.dot(up, down) * alpha
        if PASS == 0:
            tl.atomic_max(stats_ptr + rows, tl.max(tl.abs(w), 1), sem="relaxed")
        else:
            new_scale = tl.load(stats_ptr + rows) * RECIPROCAL
            if tl.program_id(0) == 0:
                tl.store(new_s_ptr + rows, new_scale)
            new_scale = new_scale[:, None]
            reciprocal = tl.math.div_rn(tl.full(new_scale.shape, 1.0, tl.float32), new_scale)
            q = w * reciprocal
            q = tl.fma(tl.fma(-q, new_scale, w), reciprocal, q)
            q = tl.minimum(tl.maximum(q, -448.0), 448.0)
            tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty))


def stripes(out, new_scale, stats, pristine, scale, up, down, bm, bn, row_tiles, stages, warps):
    m, n = pristine.shape
    rank = down.shape[0]
    grid = (n // bn, m // (bm * row_tiles))
    stats.zero_()
    for step in (0, 1):
        stripes_kernel[grid](out, new_scale, stats, pristine, scale, up, down, m, n, rank, 0.8, PASS=step,
                             RECIPROCAL=RECIPROCAL_448, BM=bm, BN=bn, BK=rank, ROW_TILES=row_tiles, STAGES=stages,
                             num_warps=warps)


def ranks(rows: list) -> None:
    for name, (m, n) in SHAPES.items():
        for rank in (4, 8, 16, 32, 64):
            out, pristine, scale, up, down = weight(m, n, rank)
            new_scale = torch.empty_like(scale)
            timed(rows, f"ranks {name} {m}x{n} rank {rank}",
                  lambda: float8_kernels.requantize_into(out, new_scale, pristine, scale, up, down, 0.8), 3 * m * n)


def product(rows: list) -> None:
    for name, (m, n) in SHAPES.items():
        out, pristine, scale, up, down = weight(m, n, 32)
        new_scale = torch.empty_like(scale)
        for with_product in (True, False):
            timed(rows, f"product {name} {m}x{n} with_product={with_product}",
                  lambda: rows_kernel[(m // 16,)](out, pristine, scale, new_scale, up, down, m, n, 32, 0.8,
                                                 RECIPROCAL=RECIPROCAL_448, BM=16, BN=256, BK=32, STAGES=3, DIV=2,
                                                 PRODUCT=with_product, num_warps=4), 3 * m * n)


# rows, columns, row tiles, stages, warps
STRIPE_CONFIGS = [(64, 128, 8, 2, 4), (64, 128, 16, 3, 4), (32, 128, 16, 3, 4)]


def stripe_runs(rows: list) -> None:
    for name, (m, n) in {**SHAPES, **OTHER_SHAPES}.items():
        out, pristine, scale, up, down = weight(m, n, 32)
        served, served_scale = torch.empty_like(out), torch.empty_like(scale)
        timed(rows, f"stripes {name} {m}x{n} served",
              lambda: float8_kernels.requantize_into(served, served_scale, pristine, scale, up, down, 0.8), 3 * m * n)
        new_scale, stats = torch.empty_like(scale), torch.empty(m, device="cuda")
        for config in STRIPE_CONFIGS:
            bm, bn, row_tiles = config[:3]
            if m % (bm * row_tiles) or n % bn:
                continue
            try:
                timed(rows, f"stripes {name} {m}x{n} {config}",
                      lambda: stripes(out, new_scale, stats, pristine, scale, up, down, *config), 3 * m * n)
            except Exception as e:  # noqa: BLE001 - a tile this GPU cannot hold
                print(f"stripes {config}: {type(e).__name__}: {str(e)[:200]}")
                continue
            stripes(out, new_scale, stats, pristine, scale, up, down, *config)
            rows[-1]["values_differ"] = int((out.view(torch.uint8) != served.view(torch.uint8)).sum())
            rows[-1]["scales_differ"] = int((new_scale != served_scale).sum())
            print(f"  against served: {rows[-1]['values_differ']} values, {rows[-1]['scales_differ']} scales differ")


RUNS = {"ranks": ranks, "product": product, "stripes": stripe_runs}


if __name__ == "__main__":
    variants.main(RUNS, __doc__)
