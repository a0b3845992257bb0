"""The float8 re-quantization kernel (`kernels.requantize_into`) and variants of it, on a GPU,
at FLUX.2 [dev]'s largest weights with a rank-32 LoRA (median times, `triton.testing.do_bench`):

- `tiles`: the kernel itself at several tile sizes and warp counts, at three weights, with
  the rate at its own traffic (the float8 weight read by both passes and written by the
  second: 3 bytes a weight);
- `parts`: a copy of its two passes with the rank-r tile product (`DOT`) and the IEEE
  division (`DIV`) each switchable, at three tile shapes, on the largest weight;
- `loops`: that copy against programs that loop over a row block's column tiles (`nloop`:
  the `up` rows loaded once, the row maxima kept in registers, no atomics) or over a column
  tile's row blocks (`mloop`: the `down` columns loaded once), at several tiles, warps and
  pipelining depths.

The copies are for measuring only: the swap runs `kernels.py`.

    PYTHONPATH=src python scripts/float8_kernel_variants.py [--runs tiles,parts,loops] [--out OUT.json]
"""

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from loraswap.engine import kernels

SHAPES = {"single block to_qkv_mlp_proj": (55296, 6144), "single block to_out": (6144, 24576),
          "double block ff in": (36864, 6144)}
RANK = 32
TILE_CONFIGS = [(64, 128, 32, 4), (128, 128, 32, 4), (128, 128, 32, 8), (64, 256, 32, 4), (128, 256, 32, 8),
                (256, 128, 32, 8)]


@triton.jit
def _finish(w, stats_ptr, out_ptr, rows, offsets, PASS: tl.constexpr, DIV: tl.constexpr):
    """Pass 1: each row's largest |W| into `stats`; pass 2: W / stats as float8."""
    if PASS == 0:
        tl.atomic_max(stats_ptr + rows, tl.max(tl.abs(w), 1))
    else:
        new_scale = tl.load(stats_ptr + rows)[:, None]
        q = tl.math.div_rn(w, new_scale) if DIV else w * (1.0 / new_scale)
        tl.store(out_ptr + offsets, tl.minimum(tl.maximum(q, -448.0), 448.0).to(out_ptr.dtype.element_ty))


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
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    ks = tl.arange(0, BK)
    up = tl.load(b_ptr + rows[:, None] * K + ks[None, :])
    scale = tl.load(s_ptr + rows)[:, None]
    largest = tl.full((BM,), 0.0, tl.float32)
    for n0 in tl.range(0, N, BN, num_stages=STAGES):
        cols = n0 + tl.arange(0, BN)
        offsets = rows[:, None] * N + cols[None, :]
        acc = tl.dot(up, tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :]))
        w = tl.load(p_ptr + offsets).to(tl.float32) * scale + acc * alpha
        if PASS == 0:
            largest = tl.maximum(largest, tl.max(tl.abs(w), 1))
        else:
            _finish(w, stats_ptr, out_ptr, rows, offsets, PASS, True)
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
        _finish(w, stats_ptr, out_ptr, rows, offsets, PASS, True)


def weight(m: int, n: int) -> tuple:
    """A float8 weight of m x n, its pristine copy and scale, a rank-32 LoRA's factors, stats."""
    qdata = (torch.randn(m, n, device="cuda") * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(m, 1, device="cuda") * 1e-3
    up = torch.randn(m, RANK, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(RANK, n, device="cuda", dtype=torch.bfloat16) * 0.01
    return qdata, qdata.clone(), scale, up, down, torch.rand(m, device="cuda") + 0.5


def timed(rows: list, name: str, run, moved: int | None = None) -> None:
    ms = do_bench(run, warmup=20, rep=100, return_mode="median")
    rows.append({"case": name, "ms": ms, **({"TBps": moved / ms / 1e9} if moved else {})})
    print(f"{name:48} {ms:.3f} ms" + (f", {rows[-1]['TBps']:.2f} TB/s" if moved else ""), flush=True)


def tile_sizes(rows: list) -> None:
    for name, (m, n) in SHAPES.items():
        qdata, pristine, scale, up, down, _ = weight(m, n)
        pristine_scale = scale.clone()
        for config in TILE_CONFIGS:
            kernels.BLOCK_M, kernels.BLOCK_N, kernels.BLOCK_K, kernels.NUM_WARPS = config
            timed(rows, f"{name} {m}x{n} {config}",
                  lambda: kernels.requantize_into(qdata, scale, pristine, pristine_scale, up, down, 0.8), 3 * m * n)


def parts(rows: list) -> None:
    m, n = SHAPES["single block to_qkv_mlp_proj"]
    args = (*weight(m, n), m, n, RANK, 0.8)
    for bm, bn, warps in [(64, 128, 4), (32, 256, 4), (16, 512, 4)]:
        for step, dot, div in [(0, True, True), (0, False, True), (1, True, True), (1, True, False),
                               (1, False, True), (1, False, False)]:
            timed(rows, f"parts {bm}x{bn} pass {step + 1} product={dot} division={div}",
                  lambda: tiles[(m // bm * (n // bn),)](*args, PASS=step, BM=bm, BN=bn, BK=RANK, DOT=dot, DIV=div,
                                                        num_warps=warps))


def loops(rows: list) -> None:
    m, n = SHAPES["single block to_qkv_mlp_proj"]
    args = (*weight(m, n), m, n, RANK, 0.8)
    for step in (0, 1):
        timed(rows, f"loops pass {step + 1} tiles 64x128",
              lambda: tiles[(m // 64 * (n // 128),)](*args, PASS=step, BM=64, BN=128, BK=RANK, DOT=True, DIV=True,
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


RUNS = {"tiles": tile_sizes, "parts": parts, "loops": loops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list = []
    for run in args.runs.split(","):
        RUNS[run](rows)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
