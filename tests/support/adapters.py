"""Bound adapters of a given size, for cache and budget tests."""

import torch

from loraswap.adapters.bound import BoundAdapter
from loraswap.adapters.kinds import LORA, Layer

MB = 2**20


def adapter(name: str, mib: int) -> BoundAdapter:
    """A bound adapter whose factors take `mib` MiB (fp32)."""
    n = mib * MB // 4 // 2
    layer = Layer(LORA, {"down": torch.zeros(1, n), "up": torch.zeros(n, 1)})
    return BoundAdapter(name, {("unet", "x.weight"): layer})
