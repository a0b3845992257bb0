"""`lokr-rows`: some rows of a Kronecker product, made by the parser where a model splits a
file's LoKr module (fused qkv, say) and the split does not fall on w1's blocks: row i is
kron(`w1`[i], `w2`[i]), `w2` given whole or as `w2a` [n, r] @ `w2b`. Shown as `lokr`."""

import math

import torch

from loraswap.adapters.kinds.base import AdapterKind, Layer, add_product_in_place, matrix


class LoKrRows(AdapterKind):
    name = "lokr-rows"
    label = "lokr"
    read_from_files = False

    def rank(self, factors: dict) -> int:
        return factors["w2b"].shape[0] if "w2b" in factors else 0  # 0: w2 full

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        f = factors
        width = math.prod(f["w2"].shape[1:]) if "w2" in f else math.prod(f["w2b"].shape[1:])
        return (f["w1"].shape[0], f["w1"].shape[1] * width)

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        w2 = _w2(f)
        return (f["w1"][:, :, None] * w2[:, None, :]).reshape(w2.shape[0], -1)  # row-wise Kronecker products

    def write_in_place(self, target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> bool:
        """The rows' products added without materializing them: the weight viewed [n, b, q]
        takes w1[n, b, 1] * w2[n, 1, q] in one broadcast pass."""
        if not (target.is_contiguous() and source.is_contiguous()):
            return False
        f = {k: v.to(target.dtype) for k, v in layer.factors.items() if k != "magnitude"}
        w1 = f["w1"]
        w2 = f["w2"].reshape(w1.shape[0], -1) if "w2" in f else _w2(f)
        n, b, q = w1.shape[0], w1.shape[1], w2.shape[1]
        return add_product_in_place(target, source, (n, b, q), w1.view(n, b, 1), w2.view(n, 1, q), blend * layer.scale)


def _w2(f: dict) -> torch.Tensor:
    return matrix(f["w2"]) if "w2" in f else f["w2a"] @ matrix(f["w2b"])


LOKR_ROWS = LoKrRows()
