"""A float8 weight's swap launched without Triton's per-call work.

`kernel[grid](...)` binds and specializes the per-row kernel's 29 arguments on every call:
on an H100 machine's host that took about 25 us, against 11 us to launch the compiled
variant itself, and a swap launches the kernel once per layer (418 times on FLUX.1, whose
rank-16 swap is 15.5 ms of GPU work in 21.1 ms; bench/results/float8-h100-2026-12-06/).
`PreparedRows` keeps, for one weight, the compiled variant its first launch took for each
rank, factor dtype and factor alignment (what Triton specializes on that can change from
one swap of that weight to the next) and launches it with the next factors directly. One
plain LoRA per swap takes it; blends and other kinds go through `requantize_into`. Not yet
switched on (`PreparedRows.enabled`).
"""

import logging

import torch

from .float8_kernels import _per_row_kernel, requantize_into
from .float8_rounding import interpreting

logger = logging.getLogger(__name__)

UP_ARGUMENTS = ("b_ptr", "b2_ptr", "alphas_ptr", "m_ptr")  # (a plain LoRA passes `up` where it has no other)
DOWN_ARGUMENTS = ("a_ptr", "a2_ptr")


class PreparedRows:
    """The per-row kernel's compiled variants for one float8 weight (`Fp8Weight`), by rank,
    factor dtypes and alignments, each with the arguments of its first launch."""

    # Off until the served path has run on a GPU (`scripts/float8_launch_check.py`: bitwise
    # against Triton's launch, and the host time); the mechanism itself has (a compiled
    # variant launched directly wrote Triton's launch's output bitwise on an H100). Turned off
    # for the process after a Triton whose compiled kernels launch differently.
    enabled = False

    def __init__(self) -> None:
        self._variants: dict[tuple, tuple] = {}

    def write(self, qdata: torch.Tensor, scale: torch.Tensor, pristine_qdata: torch.Tensor,
              pristine_scale: torch.Tensor, up: torch.Tensor, down: torch.Tensor, alpha: float) -> None:
        """`requantize_into` for one plain LoRA, with a scale per row, all on one CUDA device."""
        if not PreparedRows.enabled or interpreting():
            requantize_into(qdata, scale, pristine_qdata, pristine_scale, up, down, alpha)
            return
        key = (down.shape[0], up.dtype, down.dtype, up.data_ptr() % 16, down.data_ptr() % 16, up.is_contiguous(),
               down.is_contiguous())
        variant = self._variants.get(key)
        if variant is None:
            made = requantize_into(qdata, scale, pristine_qdata, pristine_scale, up, down, alpha)
            self._variants[key] = _prepare(made)
            return
        if variant is False:  # (this Triton could not give the compiled variant)
            requantize_into(qdata, scale, pristine_qdata, pristine_scale, up, down, alpha)
            return
        runner, template, ups, downs, alpha_at = variant
        arguments = list(template)
        for i in ups:
            arguments[i] = up
        for i in downs:
            arguments[i] = down
        arguments[alpha_at] = float(alpha)
        try:
            runner(*arguments)
        except TypeError:  # the launcher took other arguments (nothing ran): Triton's own launch from now on
            logger.warning("float8 swaps launch through Triton's own binding: this Triton's compiled kernels take "
                           "other arguments")
            PreparedRows.enabled = False
            requantize_into(qdata, scale, pristine_qdata, pristine_scale, up, down, alpha)


def _prepare(made) -> tuple | bool:
    """(runner, argument template, positions of `up`, of `down`, of alpha) for a `RowLaunch`
    (which has run): the compiled variant Triton chose for those arguments, with every
    argument in its signature's order (the constants after the tensors and numbers), the
    factors left out (the cache may free them); False where this Triton cannot give it."""
    kernel = _per_row_kernel()
    names = kernel.arg_names
    try:
        runner = kernel.warmup(*made.args, grid=made.grid, **made.options)[(made.grid[0], 1, 1)]
    except Exception:  # noqa: BLE001 - another Triton's API: its own launch stays (the weight is written)
        logger.warning("float8 swaps launch through Triton's own binding: no compiled variant", exc_info=True)
        PreparedRows.enabled = False
        return False
    ups, downs = [names.index(n) for n in UP_ARGUMENTS], [names.index(n) for n in DOWN_ARGUMENTS]
    template = list(made.args) + [made.options[name] for name in names[len(made.args):]]
    for i in ups + downs:
        template[i] = None
    return runner, template, ups, downs, names.index("alpha")
