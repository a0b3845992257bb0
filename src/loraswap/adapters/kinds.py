"""What each adapter kind does to one parameter of the model.

Every kind people share is a change of a weight (DoRA: a new weight), so every kind is
fused: the swap writes `change(pristine)` into the parameter and the model runs at the
base model's speed. The formulas, scales and axes are those of the trainers' own code
(LyCORIS `lycoris/functional/`, PEFT `tuners/lora/dora.py`); the unit tests check them
against those libraries.

Factor names (the file's names without their prefixes):
- `lora`: `down` [r, in, (kh, kw)], `up` [out, r, (1, 1)], optional Tucker `mid`
  [r, r, kh, kw] (LoCon): dW = up @ down, or mid contracted with both.
- `loha`: `w1a` [out, r], `w1b` [r, in*k], `w2a`, `w2b` (Tucker: `t1`, `t2` [r, r, kh, kw]
  with `w1a` [r, out], `w1b` [r, in]): dW = (w1a @ w1b) * (w2a @ w2b).
- `lokr`: `w1` or `w1a` @ `w1b`, `w2` or `w2a` @ `w2b` (Tucker `t2`): dW = kron(w1, w2).
- `lokr-rows`: some rows of a Kronecker product (a fused module the model splits, whose
  split does not fall on w1's blocks): row i is kron(`w1`[i], `w2`[i]), `w2` given whole
  or as `w2a` [n, r] @ `w2b`.
- `full`: `diff`, a difference of the whole parameter (weights, biases, norms).
Any kind may carry a DoRA `magnitude`, which makes the new weight
magnitude * (W + dW) / norm(W + dW) (see `_decompose`).
"""

import math
from dataclasses import dataclass, field

import torch

KINDS = ("lora", "loha", "lokr", "lokr-rows", "full")
# DoRA conventions: PEFT normalises each output row; LyCORIS (and the kohya-style files
# other trainers write, `dora_scale`) each output row, or each input column before 3.2.
DORA_CONVENTIONS = ("peft", "lycoris-out", "lycoris-in")


@dataclass(frozen=True)
class Layer:
    """One parameter's change: `kind` with its `factors`, times `scale` (alpha / rank)."""

    kind: str
    factors: dict[str, torch.Tensor]
    scale: float = 1.0
    dora: str | None = None  # one of DORA_CONVENTIONS when `factors` has a `magnitude`
    shape: tuple[int, ...] = field(default=())  # the parameter's shape, once bound

    @property
    def down(self) -> torch.Tensor:
        return self.factors["down"]

    @property
    def up(self) -> torch.Tensor:
        return self.factors["up"]

    @property
    def plain(self) -> bool:
        """A plain low-rank pair: the one-pass swap kernel writes it."""
        return self.kind == "lora" and self.dora is None and set(self.factors) == {"down", "up"}

    @property
    def rank(self) -> int:
        f = self.factors
        if self.kind == "lora":
            return f["down"].shape[0]
        if self.kind == "loha":
            return f["w1b"].shape[0]
        if self.kind in ("lokr", "lokr-rows"):
            factored = [f[k].shape[0] for k in ("w1b", "w2b") if k in f]
            return max(factored, default=0)  # 0: both factors full
        return 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.factors.values())

    def label(self, param: str) -> str:
        """What `inspect` and `/adapters` call this change of `param`: its kind, `+dora`, or `bias`."""
        if param.endswith(".bias"):
            return "bias"
        return self.kind.removesuffix("-rows") + ("+dora" if self.dora else "")

    def replace(self, **changes) -> "Layer":
        values = {"kind": self.kind, "factors": self.factors, "scale": self.scale, "dora": self.dora,
                  "shape": self.shape} | changes
        return Layer(**values)


def delta_shape(layer: Layer) -> tuple[int, ...]:
    """The shape of the dense change a layer's factors make (before any reshape to the
    parameter: conv factors give [out, in * kh * kw] unless Tucker keeps the kernel)."""
    f = layer.factors
    if layer.kind == "full":
        return tuple(f["diff"].shape)
    if layer.kind == "lora":
        if "mid" in f:
            return (f["up"].shape[0], f["down"].shape[1], *f["mid"].shape[2:])
        return (f["up"].shape[0], *f["down"].shape[1:])
    if layer.kind == "loha":
        if "t1" in f:
            return (f["w1a"].shape[1], f["w1b"].shape[1], *f["t1"].shape[2:])
        return (f["w1a"].shape[0], *f["w1b"].shape[1:])
    if layer.kind == "lokr-rows":
        width = math.prod(f["w2"].shape[1:]) if "w2" in f else math.prod(f["w2b"].shape[1:])
        return (f["w1"].shape[0], f["w1"].shape[1] * width)
    w1 = _lokr_shape(f, "1")
    w2 = _lokr_shape(f, "2")
    return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])


def _lokr_shape(f: dict, side: str) -> tuple[int, ...]:
    if "w" + side in f:
        return tuple(f["w" + side].shape)
    a, b = f[f"w{side}a"], f[f"w{side}b"]
    if side == "2" and "t2" in f:
        return (a.shape[1], b.shape[1], *f["t2"].shape[2:])
    return (a.shape[0], *b.shape[1:])


def _tucker(core: torch.Tensor, out_factor: torch.Tensor, in_factor: torch.Tensor) -> torch.Tensor:
    """A Tucker core [i, j, kh, kw] contracted with [i, out] and [j, in]: [out, in, kh, kw]."""
    return torch.einsum("i j ..., i p, j r -> p r ...", core, out_factor, in_factor)


def delta(layer: Layer, dtype: torch.dtype) -> torch.Tensor:
    """The dense change `scale * dW`, shaped as the parameter, computed in `dtype`."""
    f = {k: v.to(dtype) for k, v in layer.factors.items() if k != "magnitude"}
    if layer.kind == "full":
        dense = f["diff"]
    elif layer.kind == "lora":
        down = f["down"].reshape(f["down"].shape[0], -1)
        if "mid" in f:
            dense = _tucker(f["mid"], f["up"].reshape(f["up"].shape[0], -1).T, down)
        else:
            dense = f["up"].reshape(f["up"].shape[0], -1) @ down
    elif layer.kind == "loha":
        if "t1" in f:
            dense = _tucker(f["t1"], f["w1a"], f["w1b"]) * _tucker(f["t2"], f["w2a"], f["w2b"])
        else:
            dense = (f["w1a"] @ f["w1b"].reshape(f["w1b"].shape[0], -1)) * \
                (f["w2a"] @ f["w2b"].reshape(f["w2b"].shape[0], -1))
    elif layer.kind == "lokr-rows":
        w2 = f["w2"].reshape(f["w2"].shape[0], -1) if "w2" in f else f["w2a"] @ f["w2b"].reshape(f["w2b"].shape[0], -1)
        dense = (f["w1"][:, :, None] * w2[:, None, :]).reshape(w2.shape[0], -1)  # row-wise Kronecker products
    else:
        w1, w2 = _lokr_side(f, "1"), _lokr_side(f, "2")
        w1 = w1.reshape(*w1.shape, *[1] * (w2.ndim - w1.ndim))  # kron pads the front; a conv's w1 is [a, b, 1, 1]
        dense = torch.kron(w1.contiguous(), w2.contiguous())
    return (dense * layer.scale).reshape(layer.shape or delta_shape(layer))


def _lokr_side(f: dict, side: str) -> torch.Tensor:
    if "w" + side in f:
        w = f["w" + side]
    elif side == "2" and "t2" in f:
        w = _tucker(f["t2"], f["w2a"], f["w2b"])
    else:
        b = f[f"w{side}b"]
        w = (f[f"w{side}a"] @ b.reshape(b.shape[0], -1)).reshape(f[f"w{side}a"].shape[0], *b.shape[1:])
    return w if w.ndim >= 2 else w.reshape(-1, 1)


def write(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> None:
    """target = source changed by `layer` at `blend` (the request's weight for the adapter).

    `target` may be `source` (a further adapter of a blend, applied to what the earlier
    ones wrote)."""
    if layer.dora is not None:
        target.copy_(_decompose(source, layer, blend))
        return
    if layer.kind == "lokr" and _kron_in_place(target, source, layer, blend):
        return
    torch.add(source, delta(layer, target.dtype), alpha=blend, out=target)


def _kron_in_place(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> bool:
    """kron(w1, w2) added without materializing it: viewed as [a, p, b, q], the weight
    takes w1[a, 1, b, 1] * w2[1, p, 1, q] in one broadcast pass."""
    f = layer.factors
    if target.ndim != 2 or "w2a" in f or "t2" in f or not target.is_contiguous() or not source.is_contiguous():
        return False
    w1 = _lokr_side({k: v.to(target.dtype) for k, v in f.items()}, "1")
    w2 = f["w2"].to(target.dtype)
    if w2.ndim != 2:
        return False
    (a, b), (p, q) = w1.shape, w2.shape
    shape4 = (a, p, b, q)
    torch.addcmul(source.view(shape4), w1.view(a, 1, b, 1), w2.view(1, p, 1, q), value=blend * layer.scale,
                  out=target.view(shape4))
    return True


def _decompose(source: torch.Tensor, layer: Layer, blend: float) -> torch.Tensor:
    """DoRA: the new weight from the current one, in fp32, as each trainer's loader does.

    PEFT: W' = m * (W + w dW) / ||W + w dW|| per output row, w the request's weight
    (it scales the LoRA inside the norm, as `set_adapters` does).
    LyCORIS: V = W + dW; W' = V * (w (m / ||V|| - 1) + 1), the norm per output row
    (`dora_scale` [out, 1]) or per input column ([1, in]): w interpolates the rescaling,
    as its network's forward does with its multiplier.
    """
    weight = source.float()
    change = delta(layer, torch.float32)
    magnitude = layer.factors["magnitude"].float()
    if layer.dora == "peft":
        merged = weight + blend * change
        norm = merged.reshape(merged.shape[0], -1).norm(dim=1)
        return merged * (magnitude.reshape(-1) / norm).reshape(-1, *[1] * (merged.ndim - 1))
    merged = weight + change
    if layer.dora == "lycoris-out":
        norm = merged.reshape(merged.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (merged.ndim - 1))
    else:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
        norm = norm.reshape(merged.shape[1], *[1] * (merged.ndim - 1)).transpose(0, 1)
    rescale = magnitude.reshape(norm.shape) / (norm + torch.finfo(torch.float32).eps)
    return merged * (blend * (rescale - 1) + 1)


def dora_magnitude_shape(convention: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The magnitude shape each DoRA convention stores for a parameter of `shape`."""
    if convention == "peft":
        return (shape[0],)
    ones = (1,) * (len(shape) - 1)
    return (shape[0], *ones) if convention == "lycoris-out" else (1, shape[1], *ones[1:])
