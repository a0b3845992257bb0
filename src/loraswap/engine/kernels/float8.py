"""The float8 swap kernels: W = float8(dequantize(P) + alpha * B @ A), written by Triton.

P is the weight's pristine float8 copy with one fp32 scale per row or per tensor (torchao's
`Float8Tensor`); W and its new scale are written in place, by torchao's rule: the scale is
the largest |W| / 448 (of the row, or the tensor), the values W / scale clamped to +-448 and
rounded to nearest even. W is never stored in fp32: the rank-r product is computed again
where it is needed, from the factors (a few MB) rather than from a copy of the weight.

- Per row (`--quantize fp8`, `fp8-weight-only`), one launch: a program holds whole rows, finds their largest
  |W| in a first loop over the row's tiles, writes their scales, and writes the float8 rows
  in a second loop, reading P again, mostly from the L2 cache. On an H200 it took FLUX.2's
  largest weight from 0.94 ms (two launches, atomics between them) to 0.58 ms, and a FLUX.2
  rank-32 swap from 89.5 to 55.7 ms (bench/results/float8-h200/). It also takes one LoHa,
  one LoKr, and DoRA rescaling output rows (each row's norm summed in the first loop).
- Per tensor (`fp8-tensorwise`), two launches: the first takes the tensor's largest |W| by
  atomics, torch turns it into the scale, the second writes W.

Dividing by the new scale as torch does (IEEE division) cost a third of the kernel; on a GPU
it is a multiply by the row's reciprocal corrected once by the exact remainder (Markstein's
sequence), bitwise equal to IEEE division on 3.2 billion random pairs on an H200, taking
the second pass over FLUX.2's largest weight from 0.49 to 0.42 ms.
"""

from dataclasses import dataclass
from functools import cache

import torch

from loraswap.engine.kernels import fused as kernels
from loraswap.engine.kernels.float8_rounding import float8_rounding, float8_runs_on, interpreting
from loraswap.engine.kernels.fused import BLOCK_K, triton_cdiv
from loraswap.engine.kernels.triton_compile import launch

FLOAT8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# CUDA's `stats / 448` multiplies by the fp32 reciprocal of 448: the per-row kernel does the same
RECIPROCAL_FLOAT8_MAX = float(torch.tensor(1 / FLOAT8_MAX, dtype=torch.float32))
# the per-row kernel's tiles (rows, columns, most pipelining stages): 16 x 256 in general; 32 x
# 128 on weights of many short rows, 5-10% faster there on an H100 (13824 x 5120, 21504 x
# 3072, 36864 and 55296 x 6144), 10-40% slower on fewer or longer rows (5120 x 5120, 6144 x
# 24576), where it leaves too few programs (bench/results/float8-h100-2026-12-05/kernel-tiles.json)
WIDE_TILES, TALL_TILES = (16, 256, 3), (32, 128, 4)
TALL_ROWS, TALL_MAX_COLUMNS = 12288, 8192
ROWS_NUM_WARPS = 4
MAX_K_BLOCKS = 8  # the per-row kernel unrolls up to 8 blocks of ranks (`rank_block`); beyond, it loops

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: the kernels are never launched
    OutOfResources = RuntimeError


@cache
def float8_functions() -> bool:
    """Define the Triton functions both kernels call as this module's globals (where Triton
    looks them up; the tiles of B @ A are `kernels.py`'s); False without Triton."""
    global _blended_tile, _block_product, _reciprocal, _divide, _dora_factor, _inside
    global round_to_float8, tl
    if not kernels.tile_functions():
        return False
    import triton
    import triton.language as tl

    _blended_tile, _block_product, _inside = kernels._blended_tile, kernels._block_product, kernels._inside
    round_to_float8 = float8_rounding()

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
def row_functions() -> bool:
    """The per-row kernel's tiles (as `float8_functions`), with the rank unrolled."""
    global _product, _kron, _row_tile
    if not float8_functions():
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


def float8_kernels():
    """The two Triton kernels (per tensor, per row), or None without Triton (built once)."""
    per_tensor, per_row = per_tensor_kernel(), per_row_kernel()
    return None if per_tensor is None else (per_tensor, per_row)


@cache
def per_tensor_kernel():
    """Two launches: the tensor's largest |W| by atomics, then W / its scale."""
    if not float8_functions():
        return None
    import triton

    @triton.jit(do_not_specialize=["M", "alpha"])
    def requantize(out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, alphas_ptr, stats_ptr, M, N, K, alpha,
                   PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, EMULATE: tl.constexpr, BLENDED: tl.constexpr):
        # per tensor: pass 0 the largest |W| into stats[0], pass 1 W / stats[0] as float8
        acc, rows, in_m, offsets, mask = _blended_tile(b_ptr, a_ptr, alphas_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                       IEEE, BLENDED)
        w = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(s_ptr) + acc * alpha
        if PASS == 0:
            # Triton's own combines (as `kernels.fused_dora`'s): one numpy op each in its interpreter
            row_max = tl.reduce(tl.where(mask, tl.abs(w), 0.0), 1, tl.standard._elementwise_max)
            tl.atomic_max(stats_ptr, tl.reduce(row_max, 0, tl.standard._elementwise_max))
        else:
            new_scale = tl.load(stats_ptr + rows * 0)[:, None]  # [rows, 1], as `_divide` takes it
            q = round_to_float8(_divide(w, new_scale, _reciprocal(new_scale), EMULATE), EMULATE)
            tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)

    return requantize


@cache
def per_row_kernel():
    """One launch: whole rows per program, their largest |W| kept, then W / their scales."""
    if not row_functions():
        return None
    import triton

    @triton.jit(do_not_specialize=["M", "P", "Q", "alpha", "blend"])
    def requantize_rows(out_ptr, scale_out_ptr, p_ptr, s_ptr, b_ptr, a_ptr, b2_ptr, a2_ptr, alphas_ptr, m_ptr, M, N,
                        K, P, Q, alpha, blend, RECIPROCAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr, STAGES: tl.constexpr,
                        IEEE: tl.constexpr, EMULATE: tl.constexpr, BLENDED: tl.constexpr, KIND: tl.constexpr,
                        DORA: tl.constexpr, EVEN: tl.constexpr):
        # per row: BLOCK_M whole rows, their largest |W| (and DoRA's sums of squares: 1 PEFT,
        # 2 LyCORIS, per output row) in registers, then the rows as float8. EVEN: the tiles
        # and rank blocks cover the weight and the rank exactly, so no load or store is masked
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_m = _inside(rm, M, EVEN)
        rows = rm.to(tl.int64)
        scale = tl.load(s_ptr + rows, mask=in_m, other=1.0)[:, None]
        largest = tl.full((BLOCK_M,), 0.0, tl.float32)
        squares = tl.full((BLOCK_M,), 0.0, tl.float32)
        for n0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            w, offsets, mask = _row_tile(p_ptr, b_ptr, a_ptr, b2_ptr, a2_ptr, alphas_ptr, rows, in_m, scale, n0, N, K,
                                         P, Q, alpha, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BLENDED, KIND, K_BLOCKS,
                                         EVEN)
            w = tl.where(mask, w, 0.0)
            largest = tl.maximum(largest, tl.reduce(tl.abs(w), 1, tl.standard._elementwise_max))
            if DORA > 0:
                squares += tl.reduce(w * w, 1, tl.standard._sum_combine)
        if DORA > 0:  # |V f| rounds monotonically: the largest |W| is the largest |V| times |f|
            factor = _dora_factor(squares, m_ptr, rows, in_m, blend, DORA)
            largest = largest * tl.abs(factor)
        # the scale as torch computes largest / 448 where the kernel runs: divided on CPU, times
        # the reciprocal on CUDA
        if EMULATE:
            new_scale = tl.math.div_rn(largest, tl.full(largest.shape, 448.0, tl.float32))
        else:
            new_scale = largest * RECIPROCAL
        tl.store(scale_out_ptr + rows, new_scale, mask=in_m)
        new_scale = new_scale[:, None]
        reciprocal = _reciprocal(new_scale)
        for n0 in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            w, offsets, mask = _row_tile(p_ptr, b_ptr, a_ptr, b2_ptr, a2_ptr, alphas_ptr, rows, in_m, scale, n0, N, K,
                                         P, Q, alpha, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BLENDED, KIND, K_BLOCKS,
                                         EVEN)
            if DORA > 0:
                w = w * factor[:, None]
            q = round_to_float8(_divide(w, new_scale, reciprocal, EMULATE), EMULATE)
            tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)

    return requantize_rows


def float8_kernel_available(qdata: torch.Tensor) -> bool:
    """Whether `requantize_into` runs the kernel for these float8 data (else eager torch)."""
    return float8_runs_on(qdata.device) and qdata.dtype == torch.float8_e4m3fn and float8_kernels() is not None


@dataclass(frozen=True)
class DoraRows:
    """DoRA's rescaling of each output row after the change (`kinds.rescale_dora`): the
    magnitude (one per row), the request's weight, and whose convention (PEFT or LyCORIS)."""

    magnitude: torch.Tensor
    blend: float
    peft: bool


@dataclass(frozen=True)
class RowLaunch:
    """One launch of the per-row kernel: its grid, arguments and options (constants and warps)."""

    grid: tuple[int]
    args: tuple
    options: dict


ROW_CHANGES = ("low_rank", "hadamard", "kronecker")  # the per-row kernel's changes, by its KIND


def requantize_into(qdata: torch.Tensor, scale: torch.Tensor, pristine_qdata: torch.Tensor,
                    pristine_scale: torch.Tensor, up: torch.Tensor, down: torch.Tensor, alpha: float,
                    alphas: torch.Tensor | None = None, kind: str = "low_rank", second: tuple | None = None,
                    dora: DoraRows | None = None, tiles: tuple[int, int, int] | None = None) -> RowLaunch | None:
    """qdata, scale = float8(pristine_qdata * pristine_scale + alpha * up @ down), in place,
    with a scale per row (`scale` of shape [rows, 1]) or per tensor ([1, 1]); all on one device.
    With `alphas` (fp32, one per `BLOCK_K` ranks: a blend's adapters side by side, each
    padded to a multiple of `BLOCK_K`), each block of ranks is weighted by its own.

    Per row only, other changes (`kind`): "hadamard" (LoHa) (up @ down) * (up2 @ down2), with
    `second` = (up2, down2) of the same rank; "kronecker" (LoKr) kron(up, down), both whole
    matrices. `dora` rescales each row of the sum before it is quantized. `tiles`: the per-row
    kernel's (rows, columns, most pipelining stages), by default `row_tiles`' choice. Returns
    the per-row kernel's launch (`RowLaunch`; None per tensor)."""
    m, n = qdata.shape
    flags = dict(BLOCK_K=BLOCK_K, IEEE=up.dtype == torch.float32 or not qdata.is_cuda, EMULATE=not qdata.is_cuda,
                 BLENDED=alphas is not None)
    per_tensor, per_row = float8_kernels()
    if scale.numel() != 1:
        return _requantize_rows(per_row, qdata, scale, pristine_qdata, pristine_scale, up, down, alpha, alphas, kind,
                                second, dora, flags, tiles or row_tiles(m, n))
    if kind != "low_rank" or dora is not None:
        raise ValueError("LoHa, LoKr and DoRA re-quantize in the kernel with a scale per row only")
    k = down.shape[0]
    stats = torch.zeros(1, device=qdata.device, dtype=torch.float32)
    grid = (triton_cdiv(m, kernels.BLOCK_M) * triton_cdiv(n, kernels.BLOCK_N),)
    for step, largest in ((0, stats), (1, scale)):
        launch(per_tensor, grid, qdata, pristine_qdata, pristine_scale, up, down, stats if alphas is None else alphas,
               largest, m, n, k, float(alpha), PASS=step, BLOCK_M=kernels.BLOCK_M, BLOCK_N=kernels.BLOCK_N,
               num_warps=kernels.NUM_WARPS, **flags)
        if step == 0:  # the largest |W| -> the new scale, by torchao's own op, which pass 1 reads
            torch.div(stats, FLOAT8_MAX, out=scale.view(-1))
    return None


def _requantize_rows(kernel, qdata, scale, pristine_qdata, pristine_scale, up, down, alpha, alphas, kind,
                     second, dora, flags, tiles) -> RowLaunch:
    """`requantize_into` with a scale per row: one launch, its plan from the rank and tiles;
    returns the launch it made."""
    m, n = qdata.shape
    _check_row_change(m, n, kind, (up, down, *(second or ())))
    rank = 1 if kind == "kronecker" else down.shape[0]  # (LoKr has none)
    kron = down.shape if kind == "kronecker" else (1, 1)  # P, Q: the second Kronecker factor's shape
    second = second or (up, down)  # (read only by LoHa)
    block_m, block_n, _ = tiles
    block_k = rank_block(rank, alphas is not None)
    flags = {**flags, "BLOCK_K": block_k}

    def launch_plan(k_blocks: int, stages: int) -> RowLaunch:
        # no masks where the tiles cover the weight and the rank blocks the rank (or no rank: LoKr)
        even = m % block_m == 0 and n % block_n == 0 and (
            kind == "kronecker" or rank % block_k == 0 and k_blocks * block_k in (0, rank))
        made = RowLaunch((triton_cdiv(m, block_m),), (
            qdata, scale, pristine_qdata, pristine_scale, up, down, *second, up if alphas is None else alphas,
            up if dora is None else dora.magnitude, m, n, rank, *kron, float(alpha),
            float(dora.blend) if dora else 1.0), dict(
            RECIPROCAL=RECIPROCAL_FLOAT8_MAX, BLOCK_M=block_m, BLOCK_N=block_n, K_BLOCKS=k_blocks, STAGES=stages,
            KIND=ROW_CHANGES.index(kind), DORA=0 if dora is None else 1 if dora.peft else 2, EVEN=even,
            num_warps=ROWS_NUM_WARPS, **flags))
        launch(kernel, made.grid, *made.args, **made.options)
        return made

    plan = (1, tiles[2]) if kind == "kronecker" else row_plan(
        rank, up.element_size() * (2 if kind == "hadamard" else 1), qdata.device, tiles, block_k)
    short = (qdata.device, kind, plan, tiles, block_k, up.dtype, alphas is not None, dora is not None)
    if short in SHORT_OF_MEMORY:
        return launch_plan(0, 1)
    try:
        return launch_plan(*plan)
    except OutOfResources:  # the plan's estimate of shared memory was short (nothing ran): loop, from now on
        SHORT_OF_MEMORY.add(short)
        return launch_plan(0, 1)


SHORT_OF_MEMORY: set[tuple] = set()  # the per-row kernel's plans that ran out of shared memory


def _check_row_change(m: int, n: int, kind: str, operands: tuple) -> None:
    """A ValueError unless the per-row kernel can write this change into an m x n weight."""
    if kind not in ROW_CHANGES:
        raise ValueError(f"unknown change '{kind}'; the per-row kernel writes {', '.join(ROW_CHANGES)}")
    if kind == "hadamard" and len(operands) != 4:
        raise ValueError("a LoHa change needs its second pair (up2, down2)")
    if kind == "kronecker" and (operands[0].shape[0] * operands[1].shape[0], operands[0].shape[1] *
                                operands[1].shape[1]) != (m, n):
        raise ValueError(f"kron of {tuple(operands[0].shape)} and {tuple(operands[1].shape)} is not {m} x {n}")
    if not all(x.is_contiguous() for x in operands):
        raise ValueError("the per-row kernel reads contiguous factors; pass .contiguous() ones")


def row_tiles(m: int, n: int) -> tuple[int, int, int]:
    """The per-row kernel's tiles for an m x n weight: (rows, columns, most pipelining stages)."""
    if interpreting():  # a tile's cost is its size there: small ones for the tests' small weights
        return 16, 64, WIDE_TILES[2]
    return TALL_TILES if m >= TALL_ROWS and n <= TALL_MAX_COLUMNS else WIDE_TILES


def rank_block(rank: int, blended: bool) -> int:
    """How many ranks a block of the per-row kernel holds: `BLOCK_K`, or 16 for ranks up to 16
    (one block: rank 16 read without masks, where a masked block of 32 cost 13-25%; rank 8
    half masked rather than three quarters). Larger ranks gain nothing from smaller blocks:
    the blocks are unrolled in a power of two (48 ranks in 4 x 16, as masked as 2 x 32). A
    blend's weights are per `BLOCK_K` ranks."""
    return 16 if not blended and rank <= 16 else BLOCK_K


def row_plan(rank: int, itemsize: int, device: torch.device, tiles: tuple[int, int, int] = WIDE_TILES,
             block_k: int = BLOCK_K) -> tuple[int, int]:
    """(blocks of `block_k` ranks unrolled, pipelining stages) of the per-row kernel for this
    rank, bytes of the factors per rank and value (twice the values' size for LoHa's two
    pairs) and tiles: a power of two of blocks (fewer variants to compile), as many stages
    (up to the tiles' most) as the factors' and the weight's tiles fit in 70% of the GPU's
    shared memory (the rest for Triton's own buffers), or (0, 1) beyond that: a loop over
    the ranks, not pipelined."""
    block_m, block_n, most = tiles
    blocks = 1 << max(triton_cdiv(rank, block_k) - 1, 0).bit_length()
    per_stage = blocks * block_k * (block_m + block_n) * itemsize + block_m * block_n
    stages = min(most, int(0.7 * shared_memory(device)) // per_stage)
    return (blocks, stages) if blocks <= MAX_K_BLOCKS and stages >= 1 else (0, 1)


@cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on `device` (an H100's under the interpreter)."""
    if device.type != "cuda":
        return 232448
    properties = torch.cuda.get_device_properties(device)
    return getattr(properties, "shared_memory_per_block_optin", properties.shared_memory_per_block)
