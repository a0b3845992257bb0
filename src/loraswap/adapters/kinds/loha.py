"""LoHa: `w1a` [out, r], `w1b` [r, in*k], `w2a`, `w2b` (Tucker: `t1`, `t2` [r, r, kh, kw] with
`w1a` [r, out], `w1b` [r, in]): dW = (w1a @ w1b) * (w2a @ w2b), elementwise."""

import torch

from loraswap.adapters.kinds.base import AdapterKind, FastWrite, Layer, Rows, matrix, tucker


class LoHa(AdapterKind):
    name = label = "loha"
    required = (frozenset({"w1a"}), frozenset({"w1b"}), frozenset({"w2a"}), frozenset({"w2b"}))
    paired = (("t1", "t2"),)
    file_pattern = "hada_{}"

    def rank(self, factors: dict) -> int:
        return factors["w1b"].shape[0]

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        f = factors
        if "t1" in f:
            return (f["w1a"].shape[1], f["w1b"].shape[1], *f["t1"].shape[2:])
        return (f["w1a"].shape[0], *f["w1b"].shape[1:])

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        if "t1" in f:
            return tucker(f["t1"], f["w1a"], f["w1b"]) * tucker(f["t2"], f["w2a"], f["w2b"])
        return (f["w1a"] @ matrix(f["w1b"])) * (f["w2a"] @ matrix(f["w2b"]))

    def select_rows(self, factors: dict, rows: Rows) -> tuple[AdapterKind, dict]:
        f = dict(factors)
        if "t1" in f:  # Tucker: the output factor is [r, out]
            f["w1a"], f["w2a"] = f["w1a"][:, rows], f["w2a"][:, rows]
        else:
            f["w1a"], f["w2a"] = f["w1a"][rows], f["w2a"][rows]
        return self, {k: v.contiguous() for k, v in f.items()}

    def write_in_place(self, target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> bool:
        """The two products multiply-added into the weight in one pass (not Tucker)."""
        f = layer.factors
        if "t1" in f or not (target.is_contiguous() and source.is_contiguous()):
            return False
        first = f["w1a"].to(target.dtype) @ matrix(f["w1b"].to(target.dtype))
        second = f["w2a"].to(target.dtype) @ matrix(f["w2b"].to(target.dtype))
        torch.addcmul(source.view(first.shape), first, second, value=blend * layer.scale, out=target.view(first.shape))
        return True

    def fast_write(self, factors: dict) -> FastWrite | None:
        if "t1" in factors:
            return None
        f = factors  # conv factors come flattened
        return FastWrite("hadamard", (matrix(f["w1a"]), matrix(f["w1b"]), matrix(f["w2a"]), matrix(f["w2b"])))


LOHA = LoHa()
