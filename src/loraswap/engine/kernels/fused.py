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

from loraswap.engine.kernels.float8_rounding import interpreting
from loraswap.engine.kernels.triton_compile import compiled_in_parallel, launch

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 32
NUM_WARPS = 4


@cache
def tile_functions() -> bool:
    """Define the Triton functions the swap kernels share (tiles of B @ A) as this module's
    globals, where Triton looks the functions a kernel calls up; False without Triton."""
    global _lora_tile, _blended_tile, _block_product, _inside, tl
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False

    @triton.jit
    def _inside(indices, length, ALL: tl.constexpr):
        # which indices are below length; ALL: all, as a constant the compiler takes the
        # masks that use it out of the loads and stores for
        if ALL:
            inside = tl.full(indices.shape, 1, tl.int1)
        else:
            inside = indices < length
        return inside

    @triton.jit
    def _block_product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, k0, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr, BLENDED: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
        # ranks k0 to k0 + BLOCK_K of the tile (rows, rn) of B @ A, in fp32; BLENDED: times the
        # block's own weight (`alphas_ptr`: a blend's adapters side by side, a block each);
        # WHOLE_BLOCKS: every rank of the block is below K (no mask on the ranks)
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = _inside(ks, K, WHOLE_BLOCKS)
        b = tl.load(b_ptr + rows[:, None] * K + ks[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + rn[None, :], mask=in_k[:, None] & in_n[None, :],
                    other=0.0)
        if IEEE:  # fp32 weights (and the CPU interpreter, whose bf16 dot is wrong): fp32 products
            part = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(b, a)
        if BLENDED:  # (blocks unrolled past K, all zeros, read no weight: past the end may be NaN)
            part = part * tl.load(alphas_ptr + k0 // BLOCK_K, mask=k0 < K, other=0.0)
        return part

    @triton.jit
    def _blended_tile(b_ptr, a_ptr, alphas_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BLENDED: tl.constexpr):
        # this program's tile of B @ A (one tile of an M x N weight per program), with its rows
        # (int64), row mask, offsets into the weight and mask
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        pid = tl.program_id(0)
        rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, BLOCK_N), BLOCK_N)
        in_m, in_n = rm < M, rn < N
        rows = rm.to(tl.int64)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += _block_product(b_ptr, a_ptr, alphas_ptr, rows, rn, in_m, in_n, N, K, k0, BLOCK_K, IEEE, BLENDED,
                                  False)
        return acc, rows, in_m, rows[:, None] * N + rn[None, :], in_m[:, None] & in_n[None, :]

    @triton.jit
    def _lora_tile(b_ptr, a_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
        return _blended_tile(b_ptr, a_ptr, b_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, False)

    return True


@cache
def lora_kernel():
    """The LoRA kernel (W = P + alpha * B @ A), or None without Triton (built once, on first use)."""
    if not tile_functions():
        return None
    import triton

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
def loha_kernel():
    """The LoHa kernel, or None without Triton: W = P + alpha * (B1 @ A1) * (B2 @ A2), both
    rank-r products computed per tile in fp32, so P is read and W written once, as for a LoRA
    (materializing the two products takes six passes over the weight)."""
    if not tile_functions():
        return None
    import triton

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
    launch(loha_kernel(), grid, weight, pristine, up1, down1, up2, down2, m, n, down1.shape[0], float(alpha),
           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
           IEEE=weight.dtype == torch.float32 or not weight.is_cuda, num_warps=NUM_WARPS)


@cache
def dora_kernel():
    """The DoRA kernel, or None without Triton: V = P + alpha * B @ A, then W = V * f with
    one factor per row (or column) from V's norm. Pass 0 adds each tile's squares into
    `stats` (atomic add per row or column); pass 1 computes the tile again, turns the norm
    and the magnitude into the factor (PEFT: m / norm; LyCORIS: blend (m / (norm + eps) - 1)
    + 1) and writes the tile scaled: P read twice and W written once, where writing V,
    reading it for the norms and rescaling it in place costs five passes and more launches."""
    if not tile_functions():
        return None
    import triton

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
            # Triton's own sum combine: the same add compiled, and one numpy sum in its
            # interpreter, where a combine of our own runs element by element in Python
            if BY_ROW:
                tl.atomic_add(stats_ptr + rows, tl.reduce(squares, 1, tl.standard._sum_combine), mask=in_m)
            else:
                tl.atomic_add(stats_ptr + cols, tl.reduce(squares, 0, tl.standard._sum_combine), mask=in_n)
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
        launch(dora_kernel(), grid, weight, pristine, up, down, stats, magnitude, m, n, down.shape[0], float(alpha),
               float(blend), PASS=step, BY_ROW=by_row, PEFT=peft, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
               BLOCK_K=BLOCK_K, IEEE=weight.dtype == torch.float32 or not weight.is_cuda, num_warps=NUM_WARPS)


def kernel_available(weight: torch.Tensor) -> bool:
    """Whether `fuse_into` runs the one-pass kernel for this weight (else `addmm`)."""
    return (weight.is_cuda or interpreting()) and weight.dtype in _DTYPES and lora_kernel() is not None


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
    launch(lora_kernel(), grid, weight, pristine, up, down, m, n, k, float(alpha), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
           BLOCK_K=BLOCK_K, IEEE=weight.dtype == torch.float32 or not weight.is_cuda, num_warps=NUM_WARPS)


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
    than in a request's first swap (a second or more each), many at once
    (`compiled_in_parallel`)."""
    row_lengths = list(row_lengths)
    compiled_in_parallel(device, lambda: warm_up_writes(device, dtype, row_lengths))


def warm_up_writes(device: torch.device, dtype: torch.dtype, row_lengths: Iterable[int]) -> None:
    """The writes `warm_up` compiles and launches: each kind, into one small weight for each variant."""
    for n, k in variants(row_lengths):
        weight = torch.zeros(2, n, device=device, dtype=dtype)
        up, down = torch.zeros(2, k, device=device, dtype=dtype), torch.zeros(k, n, device=device, dtype=dtype)
        fuse_into(weight, weight.clone(), up, down, 1.0, use_kernel=True)
        fuse_loha_into(weight, weight.clone(), up, down, up, down, 1.0)
        for by_row in (True, False):
            for peft in (True, False):
                fuse_dora_into(weight, weight.clone(), up, down, 1.0, torch.ones(n, device=device, dtype=dtype), 1.0,
                               peft, by_row)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
