"""What every adapter kind answers (`AdapterKind`), and `Layer`: one parameter's change, a
kind with its factors.

A kind holds no tensors: it is asked about a layer's factors (their rank, the change they
make, which rows of it a split module keeps, how the trainer scales it, which one-pass
write it has). The parser, the binder and the swap ask it and never compare kind names,
so a new kind is one file beside this one, registered in `kinds/__init__.py`.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

# rows of a change's output a split module keeps: a slice when they are one run (views), else indices
Rows = torch.Tensor | slice


@dataclass(frozen=True)
class FastWrite:
    """A kind's change as the operands of one of the engine's one-pass swap kernels
    (`engine.swap` looks the kernel up by name): "low_rank" takes (up, down), W += a up @ down;
    "hadamard" takes (w1a, w1b, w2a, w2b) as matrices, W += a (w1a @ w1b) * (w2a @ w2b)."""

    kernel: Literal["low_rank", "hadamard"]
    operands: tuple[torch.Tensor, ...]


class AdapterKind:
    """One adapter kind: the file's factors of a layer -> its change. Subclasses set the class
    attributes and override the methods their kind has (the defaults: no rank, no one-pass
    write, no kernel). Instances are stateless singletons, registered by `name`."""

    name = ""  # the key the parser and the registry use ("lora", "loha", ...)
    label = ""  # what `inspect` and `/adapters` call it
    required: tuple[frozenset[str], ...] = ()  # the factors a file must hold: one of each set
    paired: tuple[tuple[str, str], ...] = ()  # factors present together or not at all
    file_pattern = "{}"  # a factor's name in a file (`hada_{}` -> `hada_w1_a`), for error messages
    read_from_files = True  # False: made by the parser only (rows of a module the model splits)

    def __repr__(self) -> str:
        return f"<adapter kind {self.name}>"

    def complete(self, factors: dict) -> bool:
        """Whether `factors` hold one of each required set."""
        return all(alternatives & factors.keys() for alternatives in self.required)

    def missing_factor_name(self, module, factor: str) -> str:
        """A missing factor named as the file of `module` (a `parse.FileModule`) would name it."""
        return self.file_pattern.format(factor[:2] + ("_" + factor[2:] if factor[2:] else ""))

    def check_factors(self, aid: str, prefix: str, factors: dict) -> None:
        """Refuse (`AdapterInvalid`) factors that are complete but contradict each other."""

    def rank(self, factors: dict) -> int:
        return 0

    def scale(self, factors: dict, alpha: float | None, target: str, config: dict) -> float:
        """alpha / rank (LyCORIS and kohya: no alpha, or 0, means alpha = rank). `target`: the
        model module; `config`: the file's PEFT adapter config, if any."""
        rank = self.rank(factors)
        if alpha is None or alpha == 0:
            alpha = float(rank)
        return alpha / rank

    def delta_shape(self, factors: dict) -> tuple[int, ...]:
        """The shape of the dense change (conv factors give [out, in * kh * kw] unless
        Tucker keeps the kernel)."""
        raise NotImplementedError

    def dense(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        """The unscaled dense change dW from factors already cast (no DoRA magnitude)."""
        raise NotImplementedError

    def select_rows(self, factors: dict, rows: Rows) -> tuple["AdapterKind", dict]:
        """The kind and factors of the change's output `rows` only (a module the model splits);
        a DoRA `magnitude` is already cut to the rows and passes through."""
        raise NotImplementedError(f"{self.name} layers cannot be cut to rows")

    def write_in_place(self, target: torch.Tensor, source: torch.Tensor, layer: "Layer", blend: float) -> bool:
        """target = source + blend * scale * dW in one pass without materializing dW, where
        the kind can; False (nothing written) where it cannot."""
        return False

    def fast_write(self, factors: dict) -> FastWrite | None:
        """The engine kernel that writes this change in one pass, with its operands; None: none."""
        return None

    def is_plain_pair(self, factors: dict) -> bool:
        """Whether the change is exactly up @ down (the float8 and DoRA kernels take those)."""
        return False

    def matrix_factors(self, factors: dict) -> frozenset[str]:
        """The factors the swap takes as matrices, viewed [rows, -1] when packed."""
        return frozenset()

    def label_of(self, factors: dict, shape: tuple[int, ...]) -> str:
        """What `inspect` and `/adapters` call a layer of this kind (`shape`: its parameter's, once bound)."""
        return self.label


@dataclass(frozen=True)
class Layer:
    """One parameter's change: `kind` with its `factors`, times `scale` (alpha / rank)."""

    kind: AdapterKind
    factors: dict[str, torch.Tensor]
    scale: float = 1.0
    dora: str | None = None  # a DoRA convention (`kinds.dora`) when `factors` has a `magnitude`
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
        return self.dora is None and self.kind.is_plain_pair(self.factors)

    @property
    def rank(self) -> int:
        return self.kind.rank(self.factors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.factors.values())

    def label(self, param: str) -> str:
        """What `inspect` and `/adapters` call this change of `param`: its kind, `+dora`, or `bias`."""
        if param.endswith(".bias"):
            return "bias"
        return self.kind.label_of(self.factors, self.shape) + ("+dora" if self.dora else "")

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
    return layer.kind.delta_shape(layer.factors)


def delta(layer: Layer, dtype: torch.dtype) -> torch.Tensor:
    """The dense change `scale * dW`, shaped as the parameter, computed in `dtype`."""
    f = {k: v.to(dtype) for k, v in layer.factors.items() if k != "magnitude"}
    return (layer.kind.dense(f) * layer.scale).reshape(layer.shape or delta_shape(layer))


def write_change(target: torch.Tensor, source: torch.Tensor, layer: Layer, blend: float) -> None:
    """target = source + blend * scale * dW, in as few passes over the weight as the kind
    allows (`AdapterKind.write_in_place`), else through the dense change."""
    if layer.kind.write_in_place(target, source, layer, blend):
        return
    torch.add(source, delta(layer, target.dtype), alpha=blend, out=target)


def tucker(core: torch.Tensor, out_factor: torch.Tensor, in_factor: torch.Tensor) -> torch.Tensor:
    """A Tucker core [i, j, kh, kw] contracted with [i, out] and [j, in]: [out, in, kh, kw]."""
    return torch.einsum("i j ..., i p, j r -> p r ...", core, out_factor, in_factor)


def matrix(t: torch.Tensor) -> torch.Tensor:
    """A factor as a matrix of its first axis (conv factors come [r, in, kh, kw])."""
    return t.reshape(t.shape[0], -1)


def add_product_in_place(target: torch.Tensor, source: torch.Tensor, shape: tuple[int, ...], first: torch.Tensor,
                         second: torch.Tensor, value: float) -> bool:
    """target = source + value * first * second, the weights viewed as `shape` and the factors
    broadcast, in one pass; False (nothing written) where `shape` is not the weight's size."""
    if math.prod(shape) != target.numel():
        return False
    torch.addcmul(source.view(shape), first, second, value=value, out=target.view(shape))
    return True
