"""The float8 re-quantization kernel (`float8_kernels.requantize_into`, one scale per row) and
variants of it, on a GPU, at FLUX.2 [dev]'s largest weights with a rank-32 LoRA (median
times, `triton.testing.do_bench`):

- `tiles`: the kernel itself at several row blocks, column tiles, pipelining depths and
  warp counts, at those three weights and three more (Wan's, FLUX.1's), with the rate at
  its own traffic (the float8 weight read twice and written once: 3 bytes a weight); at
  the tiles `row_tiles` chooses, also masked: a row fewer, a rank fewer;
- `parts`: a copy of the two-launch kernel it replaced, with the rank-r tile product (`DOT`)
  and the IEEE division (`DIV`) each switchable, at three tile shapes, on the largest weight;
- `loops`: that copy against programs that loop over a row block's column tiles (`nloop`:
  the `up` rows loaded once, the row maxima kept in registers, no atomics) or over a column
  tile's row blocks (`mloop`: the `down` columns loaded once), at several tiles, warps and
  pipelining depths.
- `division`: the division by the new scale three ways (IEEE `div_rn`; a multiply by the
  row's reciprocal; that multiply corrected once by its exact remainder, Markstein's
  sequence, which rounds as `div_rn` does): the corrected quotient against `div_rn`,
  bitwise, over random pairs, and pass 2 timed with each;
- `rows`: one launch per weight, each program a block of whole rows: the rows' largest |W|
  kept in registers, their new scales written, then the rows written as float8 (P read
  again, mostly from L2), a copy of the kernel with the division switchable, against it,
  with its output compared;
- `served`: the served kernel against that copy, with the served kernel's masks and its
  loads of the up rows in every tile put back one at a time (what makes it slower).

The copies are for measuring only: the swap runs `float8_kernels.py`.

    PYTHONPATH=src python scripts/float8_kernel_variants.py [--runs tiles,served,...] [--out OUT.json]
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from loraswap.engine import float8_kernels

SHAPES = {"single block to_qkv_mlp_proj": (55296, 6144), "single block to_out": (6144, 24576),
          "double block ff in": (36864, 6144)}
# and for the tiles only: Wan 2.2 A14B's feed-forward in and FLUX.1's single-block projection
OTHER_SHAPES = {"wan ffn in": (13824, 5120), "flux.1 single block proj": (21504, 3072), "square": (5120, 5120)}
RANK = 32
TILE_CONFIGS = [(16, 256, 3, 4), (16, 256, 4, 4), (32, 128, 4, 4), (32, 128, 3, 4), (16, 128, 3, 4),
                (32, 256, 3, 4)]  # rows, columns, stages, warps


RECIPROCAL_448 = float(torch.tensor(1 / 448, dtype=torch.float32))  # CUDA's `stats / 448`: times fp32 1/448


@triton.jit
def _divide(w, new_scale, reciprocal, DIV: tl.constexpr):
    """W / new scale: 0 a multiply by the reciprocal, 1 IEEE division, 2 Markstein's sequence."""
    if DIV == 1:
        return tl.math.div_rn(w, new_scale)
    q = w * reciprocal
    if DIV == 2:
        q = tl.fma(tl.fma(-q, new_scale, w), reciprocal, q)
    return q


@triton.jit
def _finish(w, stats_ptr, out_ptr, rows, offsets, PASS: tl.constexpr, DIV: tl.constexpr):
    """Pass 1: each row's largest |W| into `stats`; pass 2: W / stats as float8."""
    if PASS == 0:
        tl.atomic_max(stats_ptr + rows, tl.max(tl.abs(w), 1))
    else:
        new_scale = tl.load(stats_ptr + rows)[:, None]
        q = _divide(w, new_scale, tl.math.div_rn(tl.full(new_scale.shape, 1.0, tl.float32), new_scale), DIV)
        tl.store(out_ptr + offsets, tl.minimum(tl.maximum(q, -448.0), 448.0).to(out_ptr.dtype.element_ty))


@triton.jit
def _row_block(b_ptr, s_ptr, K, BM: tl.constexpr, BK: tl.constexpr):
    """A program's block of whole rows: their indices, the ranks, their up rows, their
    pristine scales and a running largest |W| per row."""
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    ks = tl.arange(0, BK)
    up = tl.load(b_ptr + rows[:, None] * K + ks[None, :])
    return rows, ks, up, tl.load(s_ptr + rows)[:, None], tl.full((BM,), 0.0, tl.float32)


@triton.jit
def _rows_tile(p_ptr, b_ptr, a_ptr, up, rows, scale, n0, M, N, K, alpha, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, RELOAD: tl.constexpr, MASKED: tl.constexpr, PRODUCT: tl.constexpr = True):
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    offsets = rows[:, None] * N + cols[None, :]
    if RELOAD:  # the up rows loaded again for every tile, with a mask on the ranks (as served)
        up = tl.load(b_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
    if MASKED:  # rows, columns and ranks masked (as served)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        down = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :],
                       mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        w = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale + tl.dot(up, down) * alpha
        w = tl.where(mask, w, 0.0)
    elif PRODUCT:
        w = tl.load(p_ptr + offsets).to(tl.float32) * scale + tl.dot(up, tl.load(a_ptr + ks[:, None].to(tl.int64) * N
                                                                                 + cols[None, :])) * alpha
    else:  # (measuring only: the weight re-quantized without the change)
        w = tl.load(p_ptr + offsets).to(tl.float32) * scale
    return w, offsets


@triton.jit
def rows_kernel(out_ptr, p_ptr, s_ptr, new_s_ptr, b_ptr, a_ptr, M, N, K, alpha, RECIPROCAL: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, DIV: tl.constexpr,
                RELOAD: tl.constexpr = False, MASKED: tl.constexpr = False, PRODUCT: tl.constexpr = True):
    rows, ks, up, scale, largest = _row_block(b_ptr, s_ptr, K, BM, BK)
    for n0 in tl.range(0, N, BN, num_stages=STAGES):
        w, offsets = _rows_tile(p_ptr, b_ptr, a_ptr, up, rows, scale, n0, M, N, K, alpha, BM, BN, BK, RELOAD, MASKED,
                                PRODUCT)
        largest = tl.maximum(largest, tl.max(tl.abs(w), 1))
    new_scale = largest * RECIPROCAL
    tl.store(new_s_ptr + rows, new_scale)
    new_scale = new_scale[:, None]
    reciprocal = tl.math.div_rn(tl.full(new_scale.shape, 1.0, tl.float32), new_scale)
    for n0 in tl.range(0, N, BN, num_stages=STAGES):
        w, offsets = _rows_tile(p_ptr, b_ptr, a_ptr, up, rows, scale, n0, M, N, K, alpha, BM, BN, BK, RELOAD, MASKED,
                                PRODUCT)
        q = tl.minimum(tl.maximum(_divide(w, new_scale, reciprocal, DIV), -448.0), 448.0).to(out_ptr.dtype.element_ty)
        if MASKED:
            tl.store(out_ptr + offsets, q, mask=(rows[:, None] < M) & (n0 + tl.arange(0, BN)[None, :] < N))
        else:
            tl.store(out_ptr + offsets, q)


@triton.jit
def division_check(w_ptr, s_ptr, count_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w, s = tl.load(w_ptr + offsets), tl.load(s_ptr + offsets)
    exact = tl.math.div_rn(w, s)
    q = _divide(w, s, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 2)
    tl.atomic_add(count_ptr, tl.sum((exact.to(tl.int32, bitcast=True) != q.to(tl.int32, bitcast=True)).to(tl.int32)))


@triton.jit
def tiles(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, DIV: tl.constexpr):
    tiles_n = (N + BN - 1) // BN
    pid = tl.program_id(0)
    rows = ((pid // tiles_n) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid % tiles_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    offsets = rows[:, None] * N + cols[None, :]
    acc = tl.full((BM, BN), 0.0, tl.float32)
    if DOT:
        acc = tl.dot(tl.load(b_ptr + rows[:, None] * K + ks[None, :]),
                     tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :]))
    w = tl.load(p_ptr + offsets).to(tl.float32) * tl.load(s_ptr + rows)[:, None] + acc * alpha
    _finish(w, stats_ptr, out_ptr, rows, offsets, PASS, DIV)


@triton.jit
def nloop(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    rows, ks, up, scale, largest = _row_block(b_ptr, s_ptr, K, BM, BK)
    for n0 in tl.range(0, N, BN, num_stages=STAGES):
        cols = n0 + tl.arange(0, BN)
        offsets = rows[:, None] * N + cols[None, :]
        acc = tl.dot(up, tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :]))
        w = tl.load(p_ptr + offsets).to(tl.float32) * scale + acc * alpha
        if PASS == 0:
            largest = tl.maximum(largest, tl.max(tl.abs(w), 1))
        else:
            _finish(w, stats_ptr, out_ptr, rows, offsets, PASS, 1)
    if PASS == 0:
        tl.store(stats_ptr + rows, largest)


@triton.jit
def mloop(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr):
    tiles_n = (N + BN - 1) // BN
    pid = tl.program_id(0)
    cols = (pid % tiles_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    down = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :])
    first = (pid // tiles_n) * BM * TILES
    for t in tl.range(0, TILES, num_stages=STAGES):
        rows = (first + t * BM + tl.arange(0, BM)).to(tl.int64)
        offsets = rows[:, None] * N + cols[None, :]
        acc = tl.dot(tl.load(b_ptr + rows[:, None] * K + ks[None, :]), down)
        w = tl.load(p_ptr + offsets).to(tl.float32) * tl.load(s_ptr + rows)[:, None] + acc * alpha
        _finish(w, stats_ptr, out_ptr, rows, offsets, PASS, 1)


def weight(m: int, n: int, rank: int = RANK) -> tuple:
    """A float8 weight of m x n, its pristine copy and scale, a rank-r LoRA's factors, stats."""
    qdata = (torch.randn(m, n, device="cuda") * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(m, 1, device="cuda") * 1e-3
    up = torch.randn(m, rank, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(rank, n, device="cuda", dtype=torch.bfloat16) * 0.01
    return qdata, qdata.clone(), scale, up, down, torch.rand(m, device="cuda") + 0.5


def timed(rows: list, name: str, run, moved: int | None = None) -> None:
    ms = do_bench(run, warmup=20, rep=100, return_mode="median")
    rows.append({"case": name, "ms": ms, **({"TBps": moved / ms / 1e9} if moved else {})})
    print(f"{name:48} {ms:.3f} ms" + (f", {rows[-1]['TBps']:.2f} TB/s" if moved else ""), flush=True)


def tile_sizes(rows: list) -> None:
    for name, (m, n) in {**SHAPES, **OTHER_SHAPES}.items():
        qdata, pristine, scale, up, down, _ = weight(m, n)
        pristine_scale = scale.clone()
        chosen, warps = float8_kernels.row_tiles(m, n), float8_kernels.ROWS_NUM_WARPS
        for config in TILE_CONFIGS:
            float8_kernels.ROWS_NUM_WARPS = config[3]
            timed(rows, f"{name} {m}x{n} {config}{' (chosen)' if config[:3] == chosen else ''}",
                  lambda: float8_kernels.requantize_into(qdata, scale, pristine, pristine_scale, up, down, 0.8,
                                                         tiles=config[:3]), 3 * m * n)
            if config[:3] == chosen:  # masked: the weight less a row; the rank less one
                for case, (q, s, p, ps, u, d) in {
                        "rows": (qdata[:-1], scale[:-1], pristine[:-1], pristine_scale[:-1], up[:-1], down),
                        "ranks": (qdata, scale, pristine, pristine_scale, up[:, :-1].contiguous(), down[:-1])}.items():
                    timed(rows, f"{name} {m}x{n} {config} masked {case}",
                          lambda: float8_kernels.requantize_into(q, s, p, ps, u, d, 0.8, tiles=config[:3]), 3 * m * n)
        float8_kernels.ROWS_NUM_WARPS = warps


def parts(rows: list) -> None:
    m, n = SHAPES["single block to_qkv_mlp_proj"]
    args = (*weight(m, n), m, n, RANK, 0.8)
    for bm, bn, warps in [(64, 128, 4), (32, 256, 4), (16, 512, 4)]:
        for step, dot, div in [(0, True, True), (0, False, True), (1, True, True), (1, True, False),
                               (1, False, True), (1, False, False)]:
            timed(rows, f"parts {bm}x{bn} pass {step + 1} product={dot} division={div}",
                  lambda: tiles[(m // bm * (n // bn),)](*args, PASS=step, BM=bm, BN=bn, BK=RANK, DOT=dot,
                                                        DIV=int(div), num_warps=warps))


def loops(rows: list) -> None:
    m, n = SHAPES["single block to_qkv_mlp_proj"]
    args = (*weight(m, n), m, n, RANK, 0.8)
    for step in (0, 1):
        timed(rows, f"loops pass {step + 1} tiles 64x128",
              lambda: tiles[(m // 64 * (n // 128),)](*args, PASS=step, BM=64, BN=128, BK=RANK, DOT=True, DIV=1,
                                                     num_warps=4))
        for bm, bn, warps, stages in [(64, 128, 4, 1), (64, 128, 4, 3), (128, 128, 8, 2), (32, 256, 4, 2),
                                      (64, 256, 8, 2)]:
            timed(rows, f"loops pass {step + 1} nloop {bm}x{bn} w{warps} s{stages}",
                  lambda: nloop[(m // bm,)](*args, PASS=step, BM=bm, BN=bn, BK=RANK, STAGES=stages, num_warps=warps))
        for bm, bn, count, warps, stages in [(64, 128, 8, 4, 1), (64, 128, 8, 4, 3), (128, 128, 4, 8, 2),
                                             (64, 256, 8, 8, 2)]:
            timed(rows, f"loops pass {step + 1} mloop {bm}x{bn}x{count} w{warps} s{stages}",
                  lambda: mloop[(m // (bm * count) * (n // bn),)](*args, PASS=step, BM=bm, BN=bn, BK=RANK,
                                                                  TILES=count, STAGES=stages, num_warps=warps))


def random_floats(count: int, exponents: tuple[int, int], mantissa_all_ones: bool = False) -> torch.Tensor:
    """fp32 values with random signs, random mantissas and exponents in [lo, hi) (biased)."""
    bits = torch.randint(0, 1 << 23, (count,), device="cuda", dtype=torch.int32)
    if mantissa_all_ones:
        bits = bits | ((1 << 23) - 1)
    bits |= torch.randint(*exponents, (count,), device="cuda", dtype=torch.int32) << 23
    bits |= torch.randint(0, 2, (count,), device="cuda", dtype=torch.int32) << 31
    return bits.view(torch.float32)


def division(rows: list) -> None:
    count, block = 1 << 26, 1024
    for name, w_exponents, s_exponents, ones in [("wide", (64, 190), (64, 190), False),
                                                  ("weights", (100, 135), (105, 125), False),
                                                  ("all-ones scales", (100, 135), (105, 125), True)]:
        wrong = torch.zeros(1, device="cuda", dtype=torch.int32)
        for _ in range(16):
            w, s = random_floats(count, w_exponents), random_floats(count, s_exponents, ones).abs()
            division_check[(count // block,)](w, s, wrong, BLOCK=block)
        rows.append({"case": f"division {name}", "pairs": 16 * count, "markstein_differs": int(wrong)})
        print(f"division {name}: Markstein differs from div_rn in {int(wrong)} of {16 * count} pairs", flush=True)
    m, n = SHAPES["single block to_qkv_mlp_proj"]
    args = (*weight(m, n), m, n, RANK, 0.8)
    for div in (1, 0, 2):
        timed(rows, f"division pass 2 64x128 division mode {div}",
              lambda: tiles[(m // 64 * (n // 128),)](*args, PASS=1, BM=64, BN=128, BK=RANK, DOT=True, DIV=div,
                                                     num_warps=4))


def served_parts(rows: list) -> None:
    """The served kernel against the copy, with the served kernel's masks and its loads of
    the up rows in every tile put back one at a time (16 x 256 tiles, 3 stages)."""
    for name, (m, n) in SHAPES.items():
        qdata, pristine, scale, up, down, _ = weight(m, n)
        pristine_scale = scale.clone()
        timed(rows, f"served {name} requantize_into",
              lambda: float8_kernels.requantize_into(qdata, scale, pristine, pristine_scale, up, down, 0.8),
              3 * m * n)
        out, new_scale = torch.empty_like(qdata), torch.empty_like(scale)
        for reload, masked in ((False, False), (True, False), (False, True), (True, True)):
            timed(rows, f"served {name} copy reload={reload} masked={masked}",
                  lambda: rows_kernel[(m // 16,)](out, pristine, pristine_scale, new_scale, up, down, m, n, RANK, 0.8,
                                                 RECIPROCAL=RECIPROCAL_448, BM=16, BN=256, BK=RANK, STAGES=3, DIV=2,
                                                 RELOAD=reload, MASKED=masked, num_warps=4), 3 * m * n)


def whole_rows(rows: list) -> None:
    for name, (m, n) in SHAPES.items():
        qdata, pristine, scale, up, down, _ = weight(m, n)
        pristine_scale = scale.clone()
        timed(rows, f"rows {name} requantize_into",
              lambda: float8_kernels.requantize_into(qdata, scale, pristine, pristine_scale, up, down, 0.8),
              3 * m * n)
        reference, reference_scale = qdata.clone(), scale.clone()
        for bm, bn, warps, stages in [(64, 128, 4, 2), (32, 128, 4, 2), (32, 256, 4, 3), (16, 256, 4, 3),
                                      (64, 256, 8, 2), (16, 512, 4, 2)]:
            for div in (2, 1):
                out, new_scale = torch.empty_like(qdata), torch.empty_like(scale)
                run = lambda: rows_kernel[(m // bm,)](out, pristine, pristine_scale, new_scale, up, down, m, n,  # noqa: E731
                                                      RANK, 0.8, RECIPROCAL=RECIPROCAL_448, BM=bm, BN=bn, BK=RANK,
                                                      STAGES=stages, DIV=div, num_warps=warps)
                timed(rows, f"rows {name} {bm}x{bn} w{warps} s{stages} division mode {div}", run, 3 * m * n)
                run()
                rows[-1]["values_differ"] = int((out.view(torch.uint8) != reference.view(torch.uint8)).sum())
                rows[-1]["scales_differ"] = int((new_scale != reference_scale).sum())
                print(f"  differs from requantize_into: {rows[-1]['values_differ']} values, "
                      f"{rows[-1]['scales_differ']} scales", flush=True)


RUNS = {"tiles": tile_sizes, "parts": parts, "loops": loops, "division": division, "rows": whole_rows,
        "served": served_parts}


def main(runs: dict = RUNS, description: str = __doc__) -> None:
    """Run the `--runs` named (all by default), each appending its rows, and write them to `--out`."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--runs", default=",".join(runs))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list = []
    for run in args.runs.split(","):
        runs[run](rows)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
