"""A full difference: `diff`, the change of the whole parameter (weights, biases, norms,
a block's modulation table), written as it is."""

import torch

from loraswap.adapters.kinds.base import AdapterKind, Rows


class Full(AdapterKind):
    name = label = "full"
    required = (frozenset({"diff"}),)
    file_pattern = "diff"

    def scale(self, factors: dict, alpha: float | None, target: str, config: dict) -> float:
        return 1.0  # a difference has no rank for an alpha to divide

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        return tuple(factors["diff"].shape)

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        return f["diff"]

    def select_rows(self, factors: dict, rows: Rows) -> tuple[AdapterKind, dict]:
        f = factors | {"diff": factors["diff"][rows]}
        return self, {k: v.contiguous() for k, v in f.items()}


FULL = Full()
