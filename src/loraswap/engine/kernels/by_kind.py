"""The engine's one-pass kernels by the name an adapter kind gives them (`kinds.FastWrite`):
a kind names its kernel and hands over its operands, so the swap never asks which kind it
writes. A kernel here is called on 2-D views with alpha = the request's weight times the
layer's scale, and says whether it wrote; where it did not, the swap falls back to the
kind's own write in torch (`kinds.write_change`)."""

import torch

from loraswap.engine.kernels.fused import fuse_into, fuse_loha_into


def _write_low_rank(weight: torch.Tensor, source: torch.Tensor, operands: tuple, alpha: float, runs: bool) -> bool:
    """W = source + alpha * up @ down: the kernel where it runs, else `addmm` (always written)."""
    up, down = operands
    fuse_into(weight, source, up, down, alpha, runs)
    return True


def _write_hadamard(weight: torch.Tensor, source: torch.Tensor, operands: tuple, alpha: float, runs: bool) -> bool:
    """W = source + alpha * (w1a @ w1b) * (w2a @ w2b), where the kernel runs (elsewhere LoHa's
    own single pass in torch is as good)."""
    if runs:
        fuse_loha_into(weight, source, *operands, alpha)
    return runs


KIND_KERNELS = {"low_rank": _write_low_rank, "hadamard": _write_hadamard}
