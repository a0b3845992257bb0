"""The one-pass swap kernel: W = P + alpha * (B @ A), written by a Triton kernel.

`torch.addmm(P, B, A, out=W)` on CUDA is two passes over the weight: a copy of P into
W, then a GEMM accumulating into W. Swapping is bound by memory bandwidth (an adapter on
every linear layer of FLUX.1 rewrites most of its weights), so the kernel reads P and
writes W once: each program computes one tile of the rank-r product in
fp32, adds the tile of P and stores it rounded once, as cuBLAS does with beta=1.
P may be W itself (a further adapter of a blend, accumulated in place).

Used on CUDA when Triton is installed; everywhere else `fuse_into` falls back to
`addmm`. `TRITON_INTERPRET=1` runs the kernel on CPU tensors (the unit tests do).
"""

from collections.abc import Iterable
from functools import cache

import torch

from .float8_rounding import float8_rounding, float8_runs_on, interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 32
NUM_WARPS = 4


@cache
def _kernel():
    """The compiled Triton kernel, or None without Triton (built once, on first use)."""
    global _lora_tile, _blended_tile  # Triton looks the functions a kernel calls up in its module's globals
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _blended_tile(b_ptr, a_ptr, alphas_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLENDED: tl.constexpr):
        # this program's tile of B @ A in fp32 (one tile of an M x N weight per program), with
        # its rows (int64), row mask, offsets into the weight and mask; BLENDED: each block of
        # BLOCK_K ranks times its own weight (`alphas_ptr`), the adapters of a blend side by side
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        pid = tl.program_id(0)
        rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        in_m, in_n = rm < M, rn < N
        rows = rm.to(tl.int64)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            b = tl.load(b_ptr + rows[:, None] * K + ks[None, :], mask=in_m[:, None] & (ks[None, :] < K), other=0.0)
            a = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + rn[None, :],
                        mask=(ks[:, None] < K) & in_n[None, :], other=0.0)
            if IEEE:  # fp32 weights (and the CPU interpreter, whose bf16 dot is wrong): fp32 products
                part = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(b, a)
            if BLENDED:
                part = part * tl.load(alphas_ptr + k0 // BLOCK_K)
            acc += part
        return acc, rows, in_m, rows[:, None] * N + rn[None, :], in_m[:, None] & in_n[None, :]

    @triton.jit
    def _lora_tile(b_ptr, a_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
        return _blended_tile(b_ptr, a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, False)

    # Weights, their copies and packed factors are 16-byte aligned, and row lengths and ranks
    # mostly multiples of 16: specialized on those (vectorized loads), the kernel has up to six
    # variants per dtype (rank 1 is one too); warm-up compiles those a model needs (`variants`).
    # M and alpha are not specialized.
    @triton.jit(do_not_specialize=["M", "alpha"])
    def fused_lora(w_ptr, p_ptr, b_ptr, a_ptr, M, N, K, alpha,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        acc, rows, in_m, offsets, mask = _lora_tile(b_ptr, a_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        p = tl.load(p_ptr + offsets, mask=mask)
        w = p.to(tl.float32) + acc * alpha
        tl.store(w_ptr + offsets, w.to(w_ptr.dtype.element_ty), mask=mask)

    return fused_lora


@cache
def _loha_kernel():
    """The LoHa kernel, or None without Triton: W = P + alpha * (B1 @ A1) * (B2 @ A2), both
    rank-r products computed per tile in fp32, so P is read and W written once, as for a LoRA
    (materializing the two products takes six passes over the weight)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    _kernel()  # defines `_lora_tile`

    @triton.jit(do_not_specialize=["M", "alpha"])
    def fused_loha(w_ptr, p_ptr, b1_ptr, a1_ptr, b2_ptr, a2_ptr, M, N, K, alpha,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        first, rows, in_m, offsets, mask = _lora_tile(b1_ptr, a1_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        second, _, _, _, _ = _lora_tile(b2_ptr, a2_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        p = tl.load(p_ptr + offsets, mask=mask)
        w = p.to(tl.float32) + first * second * alpha
        tl.store(w_ptr + offsets, w.to(w_ptr.dtype.element_ty), mask=mask)

    return fused_loha


def fuse_loha_into(weight: torch.Tensor, pristine: torch.Tensor, up1: torch.Tensor, down1: torch.Tensor,
                   up2: torch.Tensor, down2: torch.Tensor, alpha: float) -> None:
    """weight = pristine + alpha * (up1 @ down1) * (up2 @ down2), for 2-D views (`pristine`
    may be `weight`), where `kernel_available` (elsewhere `kinds.write_change` does it)."""
    m, n = weight.shape
    grid = (triton_cdiv(m, BLOCK_M) * triton_cdiv(n, BLOCK_N),)
    _loha_kernel()[grid](weight, pristine, up1, down1, up2, down2, m, n, down1.shape[0], float(alpha),
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         IEEE=weight.dtype == torch.float32 or not weight.is_cuda, num_warps=NUM_WARPS)


@cache
def _dora_kernel():
    """The DoRA kernel, or None without Triton: V = P + alpha * B @ A, then W = V * f with
    one factor per row (or column) from V's norm. Pass 0 adds each tile's squares into
    `stats` (atomic add per row or column); pass 1 computes the tile again, turns the norm
    and the magnitude into the factor (PEFT: m / norm; LyCORIS: blend (m / (norm + eps) - 1)
    + 1) and writes the tile scaled: P read twice and W written once, where writing V,
    reading it for the norms and rescaling it in place costs five passes and more launches."""
    global _sum  # (as `_lora_tile`)
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    _kernel()

    @triton.jit
    def _sum(a, b):  # tl.sum is a jit function of Triton's own, which its interpreter cannot call
        return a + b

    @triton.jit(do_not_specialize=["M", "alpha", "blend"])
    def fused_dora(w_ptr, p_ptr, b_ptr, a_ptr, stats_ptr, m_ptr, M, N, K, alpha, blend, PASS: tl.constexpr,
                   BY_ROW: tl.constexpr, PEFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        acc, rows, in_m, offsets, mask = _lora_tile(b_ptr, a_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        cols = (tl.program_id(0) % ((N + BLOCK_N - 1) // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = cols < N
        v = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + acc * alpha
        if PASS == 0:
            squares = tl.where(mask, v * v, 0.0)
            if BY_ROW:
                tl.atomic_add(stats_ptr + rows, tl.reduce(squares, 1, _sum), mask=in_m)
            else:
                tl.atomic_add(stats_ptr + cols, tl.reduce(squares, 0, _sum), mask=in_n)
        else:
            if BY_ROW:
                norm = tl.sqrt(tl.load(stats_ptr + rows, mask=in_m, other=1.0))[:, None]
                magnitude = tl.load(m_ptr + rows, mask=in_m, other=1.0).to(tl.float32)[:, None]
            else:
                norm = tl.sqrt(tl.load(stats_ptr + cols, mask=in_n, other=1.0))[None, :]
                magnitude = tl.load(m_ptr + cols, mask=in_n, other=1.0).to(tl.float32)[None, :]
            if PEFT:
                factor = magnitude / norm
            else:
                factor = blend * (magnitude / (norm + 1.1920928955078125e-07) - 1.0) + 1.0  # fp32 eps, as LyCORIS
            tl.store(w_ptr + offsets, (v * factor).to(w_ptr.dtype.element_ty), mask=mask)

    return fused_dora


def fuse_dora_into(weight: torch.Tensor, pristine: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   alpha: float, magnitude: torch.Tensor, blend: float, peft: bool, by_row: bool) -> None:
    """weight = V * factor(norm of V, magnitude), V = pristine + alpha * up @ down, for 2-D
    views: norms per row (`by_row`) or column; the factor is PEFT's (`peft`) or LyCORIS's
    at the request's weight `blend` (`kinds.dora_factors` is the same rule in torch)."""
    m, n = weight.shape
    stats = torch.zeros(m if by_row else n, device=weight.device, dtype=torch.float32)
    grid = (triton_cdiv(m, BLOCK_M) * triton_cdiv(n, BLOCK_N),)
    for step in (0, 1):
        _dora_kernel()[grid](weight, pristine, up, down, stats, magnitude, m, n, down.shape[0], float(alpha),
                             float(blend), PASS=step, BY_ROW=by_row, PEFT=peft, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K, IEEE=weight.dtype == torch.float32 or not weight.is_cuda,
                             num_warps=NUM_WARPS)


FLOAT8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@cache
def _float8_kernel():
    """The float8 re-quantization kernel, or None without Triton (built once, on first use).

    One program per tile of W = dequantize(P) + alpha * B @ A, with P float8 and one fp32
    scale per row or per tensor. Pass 0 takes each row's (or the tensor's) largest |W|
    into `stats` (atomic max over the row's tiles); torch turns that into the new scale,
    amax / 448, as torchao does, written into the weight's scale; pass 1 computes the tile
    again (W is never stored in fp32) and writes it as float8 by torchao's rule: divide by
    the new scale, clamp to +-448, round to nearest even; NaN stays NaN. P is read twice and
    W written once, 3 bytes a weight against some 40 through eager ops; on an H200 the
    rank-r product computed twice and the IEEE division cost more than that traffic
    (bench/results/runs/2026-12-05-float8-h200.md).
    """
    global _larger, round_to_float8  # (as `_lora_tile`)
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    _kernel()  # defines `_blended_tile`, the tile of B @ A the kernels compute
    round_to_float8 = float8_rounding()

    @triton.jit
    def _larger(a, b):  # tl.max is a jit function of Triton's own, which its interpreter cannot call
        return tl.maximum(a, b)

    @triton.jit(do_not_specialize=["M", "alpha"])
    def requantize(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, alphas_ptr, stats_ptr, M, N, K, alpha, PASS: tl.constexpr,
                   PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, EMULATE: tl.constexpr, BLENDED: tl.constexpr):
        acc, rows, in_m, offsets, mask = _blended_tile(b_ptr, a_ptr, alphas_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                       IEEE, BLENDED)
        if PER_ROW:
            scale = tl.load(s_ptr + rows, mask=in_m, other=1.0)[:, None]
        else:
            scale = tl.load(s_ptr)
        w = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale + acc * alpha
        if PASS == 0:
            row_max = tl.reduce(tl.where(mask, tl.abs(w), 0.0), 1, _larger)
            if PER_ROW:
                tl.atomic_max(stats_ptr + rows, row_max, mask=in_m)
            else:
                tl.atomic_max(stats_ptr, tl.reduce(row_max, 0, _larger))
        else:
            if PER_ROW:
                new_scale = tl.load(stats_ptr + rows, mask=in_m, other=1.0)[:, None]
            else:
                new_scale = tl.load(stats_ptr)
            q = round_to_float8(tl.math.div_rn(w, new_scale), EMULATE)  # IEEE division, as torch's tensor / tensor
            tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)

    return requantize


def float8_kernel_available(qdata: torch.Tensor) -> bool:
    """Whether `requantize_into` runs the kernel for these float8 data (else eager torch)."""
    return float8_runs_on(qdata.device) and qdata.dtype == torch.float8_e4m3fn and _float8_kernel() is not None


def requantize_into(qdata: torch.Tensor, scale: torch.Tensor, pristine_qdata: torch.Tensor,
                    pristine_scale: torch.Tensor, up: torch.Tensor, down: torch.Tensor, alpha: float,
                    alphas: torch.Tensor | None = None) -> None:
    """qdata, scale = float8(pristine_qdata * pristine_scale + alpha * up @ down), in place,
    with a scale per row (`scale` of shape [rows, 1]) or per tensor ([1, 1]); all on one device.
    With `alphas` (fp32, one per `BLOCK_K` ranks: a blend's adapters side by side, each
    padded to a multiple of `BLOCK_K`), each block of ranks is weighted by its own."""
    m, n = qdata.shape
    k = down.shape[0]
    per_row = scale.numel() != 1
    stats = torch.zeros(m if per_row else 1, device=qdata.device, dtype=torch.float32)
    grid = (triton_cdiv(m, BLOCK_M) * triton_cdiv(n, BLOCK_N),)
    for step, largest in ((0, stats), (1, scale)):
        _float8_kernel()[grid](qdata, pristine_qdata, pristine_scale, up, down, stats if alphas is None else alphas,
                               largest, m, n, k, float(alpha), PASS=step, PER_ROW=per_row, BLOCK_M=BLOCK_M,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=up.dtype == torch.float32 or not qdata.is_cuda,
                               EMULATE=not qdata.is_cuda, BLENDED=alphas is not None, num_warps=NUM_WARPS)
        if step == 0:  # the largest |W| -> the new scale, by torchao's own op (CUDA divides by 448 as a
            torch.div(stats, FLOAT8_MAX, out=scale.view(-1))  # multiply by its reciprocal), which pass 1 reads


def kernel_available(weight: torch.Tensor) -> bool:
    """Whether `fuse_into` runs the one-pass kernel for this weight (else `addmm`)."""
    return (weight.is_cuda or interpreting()) and weight.dtype in _DTYPES and _kernel() is not None


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fuse_into(weight: torch.Tensor, pristine: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              alpha: float, use_kernel: bool) -> None:
    """weight = pristine + alpha * up @ down, for 2-D views (`pristine` may be `weight`).

    `use_kernel` comes from `kernel_available`, asked once per model: the kernel needs
    contiguous rows, which 2-D views of parameters and packed factors always have."""
    if not use_kernel:
        if pristine is weight:
            weight.addmm_(up, down, alpha=alpha)
        else:
            torch.addmm(pristine, up, down, alpha=alpha, out=weight)
        return
    m, n = weight.shape
    k = down.shape[0]
    grid = (triton_cdiv(m, BLOCK_M) * triton_cdiv(n, BLOCK_N),)
    _kernel()[grid](weight, pristine, up, down, m, n, k, float(alpha), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                    BLOCK_K=BLOCK_K, IEEE=weight.dtype == torch.float32 or not weight.is_cuda,
                    num_warps=NUM_WARPS)


RANKS = (16, 8, 1)  # one rank per variant: a multiple of 16, not one, and 1


def variants(row_lengths: Iterable[int]) -> list[tuple[int, int]]:
    """(row length, rank) of one small weight per kernel variant that weights with these row
    lengths need: Triton specializes an integer argument that is a multiple of 16 (vectorized
    loads) and one equal to 1, so each class of row length present, times each class of rank
    (adapters come later, any rank). Real models' row lengths are all multiples of 16, so
    they need half the variants, each compiled at start-up unless Triton's cache has it."""
    classes = {1 if n == 1 else 32 if n % 16 == 0 else 24 for n in row_lengths}
    return [(n, k) for n in sorted(classes, reverse=True) for k in RANKS]


def warm_up(device: torch.device, dtype: torch.dtype, row_lengths: Iterable[int]) -> None:
    """Compile the kernel's variants for `dtype` weights with these row lengths now, rather
    than in a request's first swap (a second or more each)."""
    for n, k in variants(row_lengths):
        weight = torch.zeros(2, n, device=device, dtype=dtype)
        up, down = torch.zeros(2, k, device=device, dtype=dtype), torch.zeros(k, n, device=device, dtype=dtype)
        fuse_into(weight, weight.clone(), up, down, 1.0, use_kernel=True)
        fuse_loha_into(weight, weight.clone(), up, down, up, down, 1.0)
        for by_row in (True, False):
            for peft in (True, False):
                fuse_dora_into(weight, weight.clone(), up, down, 1.0, torch.ones(n, device=device, dtype=dtype), 1.0,
                               peft, by_row)


def warm_up_float8(device: torch.device, per_tensor: bool, row_lengths: Iterable[int],
                   dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile `requantize_into`'s variants (both passes) for float8 weights with these row
    lengths and `dtype` factors, as `warm_up` does, and for blends where the ranks divide by
    16 (a blend's are padded to multiples of `BLOCK_K`)."""
    for n, k in variants(row_lengths):
        pristine = torch.zeros(2, n, device=device, dtype=torch.float8_e4m3fn)
        scale = torch.ones(1 if per_tensor else 2, 1, device=device)
        up, down = torch.ones(2, k, device=device, dtype=dtype), torch.ones(k, n, device=device, dtype=dtype)
        for alphas in [None] + ([torch.ones(triton_cdiv(k, BLOCK_K), device=device)] if k % 16 == 0 else []):
            requantize_into(torch.empty_like(pristine), torch.empty_like(scale), pristine, scale, up, down, 1.0, alphas)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
