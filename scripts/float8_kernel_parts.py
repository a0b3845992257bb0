"""Where the float8 re-quantization kernel's time goes, on a GPU: a copy of its two passes
(`kernels.py`'s `requantize`) with the rank-r tile product (`DOT`) and the IEEE division
(`DIV`) each switchable, timed on FLUX.2 [dev]'s largest weight (55296 x 6144, rank 32) at
three tile shapes. The copy is for measuring only: the swap runs `kernels.py`.

    python scripts/float8_kernel_parts.py
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def requantize_parts(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, DIV: tl.constexpr):
    tiles_n = (N + BN - 1) // BN
    pid = tl.program_id(0)
    rows = ((pid // tiles_n) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid % tiles_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    offsets = rows[:, None] * N + cols[None, :]
    acc = tl.full((BM, BN), 0.0, tl.float32)
    if DOT:
        for k0 in range(0, K, BK):
            b = tl.load(b_ptr + rows[:, None] * K + (k0 + ks)[None, :])
            a = tl.load(a_ptr + (k0 + ks)[:, None].to(tl.int64) * N + cols[None, :])
            acc += tl.dot(b, a)
    w = tl.load(p_ptr + offsets).to(tl.float32) * tl.load(s_ptr + rows)[:, None] + acc * alpha
    if PASS == 0:
        tl.atomic_max(stats_ptr + rows, tl.max(tl.abs(w), 1))
    else:
        new_scale = tl.load(stats_ptr + rows)[:, None]
        q = tl.math.div_rn(w, new_scale) if DIV else w * (1.0 / new_scale)
        tl.store(out_ptr + offsets, tl.minimum(tl.maximum(q, -448.0), 448.0).to(out_ptr.dtype.element_ty))


def main() -> None:
    m, n, r = 55296, 6144, 32
    qdata = (torch.randn(m, n, device="cuda") * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(m, 1, device="cuda") * 1e-3
    pristine = qdata.clone()
    up = torch.randn(m, r, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(r, n, device="cuda", dtype=torch.bfloat16) * 0.01
    stats = torch.rand(m, device="cuda") + 0.5
    for block_m, block_n, warps in [(64, 128, 4), (32, 256, 4), (16, 512, 4)]:
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        for step in (0, 1):
            for dot in (True, False):
                for div in ((True, False) if step else (True,)):
                    def run():
                        requantize_parts[grid](qdata, pristine, scale, up, down, stats, m, n, r, 0.8, PASS=step,
                                               BM=block_m, BN=block_n, BK=32, DOT=dot, DIV=div, num_warps=warps)
                    ms = do_bench(run, warmup=20, rep=100, return_mode="median")
                    print(f"{block_m}x{block_n} pass {step + 1} product={dot} division={div}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
