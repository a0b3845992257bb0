"""A float8 weight's swap launched without Triton's per-call work.

`kernel[grid](...)` binds and specializes the per-row kernel's 29 arguments on every call:
on an H100 machine's host a float8 weight's write took about 35 us that way, against 12 us
launching the compiled variant itself, bitwise the same output
(bench/results/float8-h100-2026-12-06/launch-check.json). A swap launches the kernel once
per layer (418 times on FLUX.1). On an H100 that host time hides under the GPU's work
(15.5 ms for FLUX.1's rank-16 swap, 16.46 ms of wall time through Triton's launch, 16.35
through this one); on a GPU that does that work faster the host could bound it.
`PreparedRows` keeps, for one weight, the compiled variant its first launch took for each
rank, factor dtype and factor alignment (what Triton specializes on that can change from
one swap of that weight to the next) and launches it with the next factors directly. One
plain LoRA per swap takes it; blends and other kinds go through `requantize_into`. Off
(`PreparedRows.enabled`) until it measures faster on a GPU where the host bounds the swap.
"""

import logging
from dataclasses import dataclass

import torch

from .float8_kernels import RowLaunch, per_row_kernel, requantize_into
from .float8_rounding import interpreting

logger = logging.getLogger(__name__)

UP_ARGUMENTS = ("b_ptr", "b2_ptr", "alphas_ptr", "m_ptr")  # (a plain LoRA passes `up` where it has no other)
DOWN_ARGUMENTS = ("a_ptr", "a2_ptr")


@dataclass(frozen=True)
class Variant:
    """A compiled variant's launcher, and every argument of its first launch in the kernel's
    order (the constants last) with the factors left out (the adapter cache may free them)."""

    runner: object
    arguments: tuple
    ups: tuple[int, ...]  # where `up` goes
    downs: tuple[int, ...]  # where `down` goes
    alpha_at: int


class PreparedRows:
    """The per-row kernel's compiled variants for one float8 weight (`Fp8Weight`: its data,
    scale and their pristine copies, all on one CUDA device), by rank, factor dtypes and
    whether the factors are 16-byte aligned."""

    # Off: on an H100 (Triton 3.6, whose launcher refuses a wrong count of arguments; later
    # ones may not) it wrote Triton's launch's output bitwise at every rank, dtype and
    # alignment `scripts/float8_launch_check.py` tries, but the whole swap was no faster.
    # Turned off for the process after a Triton that gives no compiled variant or refuses
    # its arguments.
    enabled = False

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, pristine_qdata: torch.Tensor,
                 pristine_scale: torch.Tensor) -> None:
        self.weight = (qdata, scale, pristine_qdata, pristine_scale)
        self._variants: dict[tuple, Variant] = {}

    def write(self, up: torch.Tensor, down: torch.Tensor, alpha: float) -> None:
        """`requantize_into` for one plain LoRA."""
        if not PreparedRows.enabled or interpreting() or not (up.is_contiguous() and down.is_contiguous()):
            requantize_into(*self.weight, up, down, alpha)  # (which refuses factors not contiguous)
            return
        # what Triton specializes on that can change from one swap of this weight to the next
        key = (down.shape[0], up.dtype, down.dtype, up.data_ptr() % 16 == 0, down.data_ptr() % 16 == 0)
        variant = self._variants.get(key)
        if variant is None:
            made = requantize_into(*self.weight, up, down, alpha)
            variant = _prepare(made)
            if variant is not None:
                self._variants[key] = variant
            return
        arguments = list(variant.arguments)
        for i in variant.ups:
            arguments[i] = up
        for i in variant.downs:
            arguments[i] = down
        arguments[variant.alpha_at] = float(alpha)
        try:
            variant.runner(*arguments)
        except TypeError:  # the launcher took other arguments (nothing ran): Triton's own launch from now on
            logger.warning("float8 swaps launch through Triton's own binding: this Triton's compiled kernels take "
                           "other arguments")
            PreparedRows.enabled = False
            requantize_into(*self.weight, up, down, alpha)


def _prepare(made: RowLaunch) -> Variant | None:
    """The compiled variant Triton chose for a launch that has run, or None (and prepared
    launches off) where this Triton cannot give it."""
    kernel = per_row_kernel()
    names = kernel.arg_names
    try:
        runner = kernel.warmup(*made.args, grid=made.grid, **made.options)[(made.grid[0], 1, 1)]
    except Exception:  # noqa: BLE001 - another Triton's API: its own launch stays (the weight is written)
        logger.warning("float8 swaps launch through Triton's own binding: no compiled variant", exc_info=True)
        PreparedRows.enabled = False
        return None
    ups = tuple(names.index(n) for n in UP_ARGUMENTS)
    downs = tuple(names.index(n) for n in DOWN_ARGUMENTS)
    arguments = list(made.args) + [made.options[name] for name in names[len(made.args):]]
    for i in ups + downs:
        arguments[i] = None
    return Variant(runner, tuple(arguments), ups, downs, names.index("alpha"))
