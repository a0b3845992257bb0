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
magnitude * (W + dW) / norm(W + dW) (see `rescale_dora`).
"""

import math
from dataclasses import dataclass, field

import torch

# DoRA conventions (`Layer.dora`): "peft" normalises each output row; LyCORIS (and the
# kohya-style files other trainers write, `dora_scale`) each output row ("lycoris-out"),
# or each input column before 3.2.0 ("lycoris-in").


@dataclass(frozen=True)
class Layer:
    """One parameter's change: `kind` with its `factors`, times `scale` (alpha / rank)."""

    kind: str
    factors: dict[str, torch.Tensor]
    scale: float = 1.0
    dora: str | None = None  # a DoRA convention (above) when `factors` has a `magnitude`
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

    def without_dora(self) -> "Layer":
        """The change alone, before DoRA's rescaling."""
        return self.replace(factors={k: v for k, v in self.factors.items() if k != "magnitude"}, dora=None)

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
    ones wrote). DoRA is the change, then the rescaling of `target` in place."""
    if layer.dora is None:
        write_change(target, source, layer, blend)
        return
    write_change(target, source, layer.without_dora(), dora_change_weight(layer, blend))
    rescale_dora(target, layer, blend)


def write_change(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> None:
    """target = source + blend * scale * dW, in as few passes over the weight as the kind
    allows: Kronecker products broadcast in one pass, LoHa's two products multiply-add in one."""
    if layer.kind in ("lokr", "lokr-rows") and _kron_in_place(target, source, layer, blend):
        return
    f = layer.factors
    if layer.kind == "loha" and "t1" not in f and target.is_contiguous() and source.is_contiguous():
        first = f["w1a"].to(target.dtype) @ f["w1b"].to(target.dtype).reshape(f["w1b"].shape[0], -1)
        second = f["w2a"].to(target.dtype) @ f["w2b"].to(target.dtype).reshape(f["w2b"].shape[0], -1)
        torch.addcmul(source.view(first.shape), first, second, value=blend * layer.scale, out=target.view(first.shape))
        return
    torch.add(source, delta(layer, target.dtype), alpha=blend, out=target)


def _kron_in_place(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> bool:
    """kron(w1, w2) added without materializing it: the weight viewed as [a, p, b, q] takes
    w1[a, 1, b, 1] * w2[1, p, 1, q] in one broadcast pass (conv kernels ride in q); rows of
    a product (`lokr-rows`), viewed [n, b, q], take w1[n, b, 1] * w2[n, 1, q]."""
    if not (target.is_contiguous() and source.is_contiguous()):
        return False
    f = {k: v.to(target.dtype) for k, v in layer.factors.items() if k != "magnitude"}
    if layer.kind == "lokr-rows":
        w1 = f["w1"]
        w2 = f["w2"].reshape(w1.shape[0], -1) if "w2" in f else f["w2a"] @ f["w2b"].reshape(f["w2b"].shape[0], -1)
        n, b, q = w1.shape[0], w1.shape[1], w2.shape[1]
        shape, first, second = (n, b, q), w1.view(n, b, 1), w2.view(n, 1, q)
    else:
        w1, w2 = _lokr_side(f, "1"), _lokr_side(f, "2")
        w1, w2 = w1.reshape(w1.shape[0], -1), w2.reshape(w2.shape[0], -1)
        (a, b), (p, q) = w1.shape, w2.shape
        shape, first, second = (a, p, b, q), w1.view(a, 1, b, 1), w2.view(1, p, 1, q)
    if math.prod(shape) != target.numel():
        return False
    torch.addcmul(source.view(shape), first, second, value=blend * layer.scale, out=target.view(shape))
    return True


def dora_change_weight(layer: Layer, blend: float) -> float:
    """What the request's weight multiplies the change by before DoRA's rescaling: PEFT
    scales the LoRA inside the norm; LyCORIS applies the whole change and interpolates the
    rescaling instead (`rescale_dora`)."""
    return blend if layer.dora == "peft" else 1.0


def rescale_dora(weight: torch.Tensor, layer: Layer, blend: float) -> None:
    """DoRA on a weight that already holds W + dW: W' = magnitude * (W + dW) / ||W + dW||,
    in place (norms in fp32), as each trainer's loader does it.

    PEFT: the norm of each output row; the request's weight w scaled dW (`set_adapters`).
    LyCORIS: the norm of each output row (`dora_scale` [out, 1]) or input column ([1, in],
    before LyCORIS 3.2.0); w interpolates the rescaling, W' = V * (w (m / ||V|| - 1) + 1),
    as its network's forward does with its multiplier.
    """
    rest = [1] * (weight.ndim - 1)
    if layer.dora == "lycoris-in":
        columns = weight.transpose(0, 1).reshape(weight.shape[1], -1)
        norm = torch.linalg.vector_norm(columns, dim=1, dtype=torch.float32)
        shape = (1, -1, *rest[1:])
    else:
        norm = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1, dtype=torch.float32)
        shape = (-1, *rest)
    weight.mul_(dora_factors(layer, blend, norm).view(shape))


def dora_factors(layer: Layer, blend: float, norm: torch.Tensor) -> torch.Tensor:
    """The fp32 factor each row (or column) of W + dW is multiplied by, from its norms."""
    magnitude = layer.factors["magnitude"].float().reshape(-1)
    if layer.dora == "peft":
        return magnitude / norm
    return blend * (magnitude / (norm + torch.finfo(torch.float32).eps) - 1) + 1


def dora_magnitude_shape(convention: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The magnitude shape each DoRA convention stores for a parameter of `shape`."""
    if convention == "peft":
        return (shape[0],)
    ones = (1,) * (len(shape) - 1)
    return (shape[0], *ones) if convention == "lycoris-out" else (1, shape[1], *ones[1:])
