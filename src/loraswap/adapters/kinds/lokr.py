"""LoKr: `w1` or `w1a` @ `w1b`, `w2` or `w2a` @ `w2b` (Tucker `t2`): dW = kron(w1, w2). Its
rows on a module the model splits are `lokr-rows` (`lokr_rows.py`)."""

import torch

from loraswap.adapters.kinds.base import AdapterKind, Layer, Rows, add_product_in_place, delta, matrix, tucker
from loraswap.adapters.kinds.lokr_rows import LOKR_ROWS
from loraswap.errors import AdapterInvalid


class LoKr(AdapterKind):
    name = label = "lokr"
    required = (frozenset({"w1", "w1a"}), frozenset({"w2", "w2a"}))
    paired = (("w1a", "w1b"), ("w2a", "w2b"))
    file_pattern = "lokr_{}"

    def check_factors(self, aid: str, prefix: str, factors: dict) -> None:
        if "w1" in factors and "w1a" in factors or "w2" in factors and "w2a" in factors:
            raise AdapterInvalid(aid, f"'{prefix}' has a LoKr factor both full and factored",
                                 "Export the adapter again")

    def rank(self, factors: dict) -> int:
        factored = [factors[k].shape[0] for k in ("w1b", "w2b") if k in factors]
        return max(factored, default=0)  # 0: both factors full

    def scale(self, factors: dict, alpha: float | None, target: str, config: dict) -> float:
        if "w1" in factors and "w2" in factors:
            return 1.0  # LyCORIS ignores a stored alpha when both Kronecker factors are full
        return super().scale(factors, alpha, target, config)

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        w1, w2 = _side_shape(factors, "1"), _side_shape(factors, "2")
        return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        w1, w2 = _side(f, "1"), _side(f, "2")
        w1 = w1.reshape(*w1.shape, *[1] * (w2.ndim - w1.ndim))  # kron pads the front; a conv's w1 is [a, b, 1, 1]
        return torch.kron(w1.contiguous(), w2.contiguous())

    def select_rows(self, factors: dict, rows: Rows) -> tuple[AdapterKind, dict]:
        """Rows of kron(w1, w2) as `lokr-rows` factors: row i*p + k is kron(w1[i], w2[k]) (p:
        the rows of w2), so each kept row takes its w1 row and its w2 row (w2 kept factored)."""
        f = factors
        rows = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        w1 = f["w1"] if "w1" in f else f["w1a"] @ f["w1b"]
        if "t2" in f:  # a Tucker w2 is rebuilt whole: it is out/a x in/b x k, far smaller than W
            w2 = delta(Layer(self, {"w1": torch.ones(1, 1), **{k: f[k] for k in ("w2a", "w2b", "t2")}}), f["t2"].dtype)
            w2 = matrix(w2)
        else:
            w2 = f.get("w2")
        p = (w2 if w2 is not None else f["w2a"]).shape[0]
        out = {"w1": w1[rows // p].contiguous()}
        if w2 is not None:
            out["w2"] = w2[rows % p].contiguous()
        else:
            out |= {"w2a": f["w2a"][rows % p].contiguous(), "w2b": f["w2b"].contiguous()}
        if "magnitude" in f:
            out["magnitude"] = f["magnitude"]
        return LOKR_ROWS, out

    def kron_matrices(self, factors: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """w1 [a, b] and w2 [p, q] whole, in `dtype` (the change is kron(w1, w2), [a p, b q])."""
        f = {k: v.to(dtype) for k, v in factors.items() if k != "magnitude"}
        return matrix(_side(f, "1")).contiguous(), matrix(_side(f, "2")).contiguous()

    def write_in_place(self, target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> bool:
        """kron(w1, w2) added without materializing it: the weight viewed as [a, p, b, q] takes
        w1[a, 1, b, 1] * w2[1, p, 1, q] in one broadcast pass (conv kernels ride in q)."""
        if not (target.is_contiguous() and source.is_contiguous()):
            return False
        w1, w2 = self.kron_matrices(layer.factors, target.dtype)
        (a, b), (p, q) = w1.shape, w2.shape
        return add_product_in_place(target, source, (a, p, b, q), w1.view(a, 1, b, 1), w2.view(1, p, 1, q),
                                    blend * layer.scale)


def _side_shape(f: dict, side: str) -> tuple[int, ...]:
    if "w" + side in f:
        return tuple(f["w" + side].shape)
    a, b = f[f"w{side}a"], f[f"w{side}b"]
    if side == "2" and "t2" in f:
        return (a.shape[1], b.shape[1], *f["t2"].shape[2:])
    return (a.shape[0], *b.shape[1:])


def _side(f: dict, side: str) -> torch.Tensor:
    """One Kronecker factor whole: given, a product of two, or (w2) a Tucker contraction."""
    if "w" + side in f:
        w = f["w" + side]
    elif side == "2" and "t2" in f:
        w = tucker(f["t2"], f["w2a"], f["w2b"])
    else:
        b = f[f"w{side}b"]
        w = (f[f"w{side}a"] @ matrix(b)).reshape(f[f"w{side}a"].shape[0], *b.shape[1:])
    return w if w.ndim >= 2 else w.reshape(-1, 1)


LOKR = LoKr()
