"""Compiling the float8 swap kernels' variants at start-up (`kernels/float8.py`), as
`kernels.warm_up` does for the plain ones: a variant compiled in a request's first swap
would cost it a second or more."""

from collections.abc import Iterable
from functools import partial

import torch

from loraswap.engine.kernels.float8 import DoraRows, requantize_into, row_tiles
from loraswap.engine.kernels.fused import BLOCK_K, triton_cdiv, variants
from loraswap.engine.kernels.triton_compile import compiled_in_parallel

# one rank per variant of the per-row kernel past one block of 16 ranks: `BLOCK_K` ranks a block,
# blocks unrolled one, two or four times (`row_plan`), the rank a multiple of 16 (whole blocks)
# and 8 short of it (Triton specializes the one and not the other)
ROW_RANKS = tuple(rank for blocks in (1, 2, 4) for rank in (blocks * BLOCK_K - 8, blocks * BLOCK_K))


def warm_up_float8(device: torch.device, per_tensor: bool, shapes: Iterable[tuple[int, int]],
                   dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile `requantize_into`'s variants for float8 weights of these shapes and `dtype`
    factors, as `kernels.warm_up` does: each class of rank (`kernels.RANKS`: ranks up to 16
    take a block of 16; per row also `ROW_RANKS`), alone and as a blend (padded to multiples
    of `BLOCK_K`); per row also LoHa and DoRA at each of those ranks and LoKr, in each tiles
    the shapes take (`row_tiles`), and unmasked at ranks of whole blocks where tiles fit.
    (Ranks past 128 compile in their first swap.) The variants compile many at once
    (`compiled_in_parallel`)."""
    shapes = list(shapes)
    compiled_in_parallel(device, lambda: warm_up_float8_writes(device, per_tensor, shapes, dtype))


def warm_up_float8_writes(device: torch.device, per_tensor: bool, shapes: list[tuple[int, int]],
                          dtype: torch.dtype) -> None:
    """The writes `warm_up_float8` compiles and launches, for each tiles the shapes take."""
    classes = variants(n for _, n in shapes)
    ranks = sorted({k for _, k in classes} | (set() if per_tensor else set(ROW_RANKS)))
    for tiles in {None} if per_tensor else {row_tiles(m, n) for m, n in shapes}:
        for n in sorted({n for n, _ in classes}):
            _one_weight_writes(device, per_tensor, (2, n), ranks, dtype, tiles)
        if tiles and any(m % tiles[0] == 0 and n % tiles[1] == 0 for m, n in shapes if row_tiles(m, n) == tiles):
            _one_weight_writes(device, per_tensor, tiles[:2], (16, BLOCK_K, 2 * BLOCK_K, 4 * BLOCK_K), dtype, tiles)


def _one_weight_writes(device: torch.device, per_tensor: bool, shape: tuple[int, int], ranks: Iterable[int],
                       dtype: torch.dtype, tiles: tuple[int, int, int] | None) -> None:
    """`warm_up_float8`'s writes into one small weight of `shape`."""
    (m, n), ones = shape, partial(torch.ones, device=device)
    weight = torch.zeros(m, n, device=device, dtype=torch.float8_e4m3fn)
    scale = ones(1 if per_tensor else m, 1)
    write = lambda *operands, **options: requantize_into(  # noqa: E731
        torch.empty_like(weight), torch.empty_like(scale), weight, scale, *operands, tiles=tiles, **options)
    for k in ranks:
        up, down = ones(m, k, dtype=dtype), ones(k, n, dtype=dtype)
        for alphas in [None] + ([ones(triton_cdiv(k, BLOCK_K))] if k % 16 == 0 else []):
            write(up, down, 1.0, alphas)
        if not per_tensor:
            write(up, down, 1.0, kind="hadamard", second=(up, down))
            for peft in (True, False):
                write(up, down, 1.0, dora=DoraRows(ones(m, dtype=dtype), 1.0, peft))  # (in the factors' dtype)
    if not per_tensor:
        write(ones(1, 1), ones(m, n), 1.0, kind="kronecker")
