"""Loop orders for the float8 re-quantization kernel, on a GPU: its two passes as they are
(one program a 64x128 tile, the rank-r product's factor tiles loaded for each) against
programs that loop over a row block's column tiles (`nloop`: the `up` rows loaded once, the
row maxima kept in registers, no atomics) or over a column tile's row blocks (`mloop`: the
`down` columns loaded once), at several tiles, warps and pipelining depths, on FLUX.2
[dev]'s largest weight (55296 x 6144, rank 32). Copies for measuring only: the swap runs
`kernels.py`.

    python scripts/float8_kernel_loops.py
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _finish(w, stats_ptr, out_ptr, rows, offsets, PASS: tl.constexpr):
    """Pass 1: each row's largest |W| into `stats`; pass 2: W / stats as float8."""
    if PASS == 0:
        tl.atomic_max(stats_ptr + rows, tl.max(tl.abs(w), 1))
    else:
        q = tl.math.div_rn(w, tl.load(stats_ptr + rows)[:, None])
        tl.store(out_ptr + offsets, tl.minimum(tl.maximum(q, -448.0), 448.0).to(out_ptr.dtype.element_ty))


@triton.jit
def tiles(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr):
    tiles_n = (N + BN - 1) // BN
    pid = tl.program_id(0)
    rows = ((pid // tiles_n) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid % tiles_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    offsets = rows[:, None] * N + cols[None, :]
    acc = tl.dot(tl.load(b_ptr + rows[:, None] * K + ks[None, :]),
                 tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :]))
    w = tl.load(p_ptr + offsets).to(tl.float32) * tl.load(s_ptr + rows)[:, None] + acc * alpha
    _finish(w, stats_ptr, out_ptr, rows, offsets, PASS)


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
            _finish(w, stats_ptr, out_ptr, rows, offsets, PASS)
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
        _finish(w, stats_ptr, out_ptr, rows, offsets, PASS)


def main() -> None:
    m, n, r = 55296, 6144, 32
    qdata = (torch.randn(m, n, device="cuda") * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(m, 1, device="cuda") * 1e-3
    pristine = qdata.clone()
    up = torch.randn(m, r, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(r, n, device="cuda", dtype=torch.bfloat16) * 0.01
    stats = torch.rand(m, device="cuda") + 0.5
    args = (qdata, pristine, scale, up, down, stats, m, n, r, 0.8)

    def report(name: str, run) -> None:
        print(f"{name:34} {do_bench(run, warmup=20, rep=100, return_mode='median'):.3f} ms", flush=True)

    for step in (0, 1):
        report(f"pass {step + 1} tiles 64x128",
               lambda: tiles[(m // 64 * (n // 128),)](*args, PASS=step, BM=64, BN=128, BK=32, num_warps=4))
        for bm, bn, warps, stages in [(64, 128, 4, 1), (64, 128, 4, 3), (128, 128, 8, 2), (32, 256, 4, 2),
                                      (64, 256, 8, 2)]:
            report(f"pass {step + 1} nloop {bm}x{bn} w{warps} s{stages}",
                   lambda: nloop[(m // bm,)](*args, PASS=step, BM=bm, BN=bn, BK=32, STAGES=stages, num_warps=warps))
        for bm, bn, count, warps, stages in [(64, 128, 8, 4, 1), (64, 128, 8, 4, 3), (128, 128, 4, 8, 2),
                                             (64, 256, 8, 8, 2)]:
            report(f"pass {step + 1} mloop {bm}x{bn}x{count} w{warps} s{stages}",
                   lambda: mloop[(m // (bm * count) * (n // bn),)](*args, PASS=step, BM=bm, BN=bn, BK=32, TILES=count,
                                                                   STAGES=stages, num_warps=warps))


if __name__ == "__main__":
    main()
