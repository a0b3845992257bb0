"""An adapter bound to one model: every layer checked against the model's modules, its
factors packed into one flat buffer so it moves between host and GPU in one copy.

`bind_adapter` is where everything that can be checked is checked (layers exist, shapes
fit, ranks under the limit, values finite), before any weight of the model is touched:
the swap itself then only writes.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AdapterIncompatible, AdapterInvalid
from .formats import LoraLayer, ParsedAdapter

LayerKey = tuple[str, str]  # (component, module name)

_ALIGN = 8  # elements: every factor starts 16-byte aligned (bf16), so the swap kernel's loads are vectorized


class ModelLayers:
    """The layers of a model that adapters may target: every Linear and Conv2d of the
    LoRA-loadable components (the denoiser, the text encoders)."""

    def __init__(self, components: dict[str, nn.Module]):
        self.modules: dict[LayerKey, nn.Module] = {
            (component, name): module
            for component, root in components.items()
            for name, module in root.named_modules()
            if isinstance(module, (nn.Linear, nn.Conv2d))
        }
        self.component_modules = {c: {n for (cc, n) in self.modules if cc == c} for c in components}


@dataclass(frozen=True)
class BoundAdapter:
    """An adapter checked against one model: every layer exists and every shape fits.

    `packed` is set when all factors are views into one flat buffer (see `to`), so the
    adapter moves between host and GPU in a single copy.
    """

    adapter_id: str
    layers: dict[LayerKey, LoraLayer]
    base_models: tuple[str, ...] = ()
    packed: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return sum(layer.nbytes for layer in self.layers.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.layers.values())).down.device

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None, pin_memory: bool = False,
           non_blocking: bool = False) -> "BoundAdapter":
        """A copy whose factors live in one flat buffer on `device` (pinned host RAM if asked).

        From a packed adapter of the same dtype this is one copy (asynchronous from
        pinned memory with `non_blocking`); otherwise the factors are packed first.
        """
        device = torch.device(device)
        dtype = dtype or next(iter(self.layers.values())).down.dtype
        if self.packed is not None and self.packed.dtype == dtype:
            flat = self.packed.to(device, non_blocking=non_blocking) if not pin_memory else self.packed.pin_memory()
        else:
            flat = self._pack(device, dtype, pin_memory and device.type == "cpu", non_blocking)
        return with_buffer(self, flat)

    def _pack(self, device: torch.device, dtype: torch.dtype, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
        spans = packed_spans(self.layers.values())
        # written once: each factor copied in, only the alignment padding between them zeroed
        flat = torch.empty(spans[-1][-1] if spans else 0, dtype=dtype, device=device, pin_memory=pin_memory)
        for layer, (down_at, up_at, end) in zip(self.layers.values(), spans):
            down_end, up_end = down_at + layer.down.numel(), up_at + layer.up.numel()
            flat[down_at: down_end].copy_(layer.down.reshape(-1), non_blocking=non_blocking)
            flat[up_at: up_end].copy_(layer.up.reshape(-1), non_blocking=non_blocking)
            if up_at > down_end:
                flat[down_end: up_at].zero_()
            if end > up_end:
                flat[up_end: end].zero_()
        return flat


def packed_spans(layers) -> list[tuple[int, int, int]]:
    """Per layer, where its down and up factors start in the packed buffer and where the
    layer's span ends (padded so the next factor starts aligned)."""
    spans, offset = [], 0
    align = lambda n: -(-n // _ALIGN) * _ALIGN  # noqa: E731
    for layer in layers:
        down_at = offset
        up_at = align(down_at + layer.down.numel())
        offset = align(up_at + layer.up.numel())
        spans.append((down_at, up_at, offset))
    return spans


def with_buffer(bound: BoundAdapter, flat: torch.Tensor) -> BoundAdapter:
    """`bound` with its factors as 2-D views into `flat` (packed in layer order: down, up).

    Down is viewed [rank, fan_in] and up [out, rank], conv factors included: the shapes
    `addmm` takes, so a swap reshapes nothing."""
    layers = {}
    for (key, layer), (down_at, up_at, _) in zip(bound.layers.items(), packed_spans(bound.layers.values())):
        down = flat[down_at: down_at + layer.down.numel()].view(layer.down.shape[0], -1)
        up = flat[up_at: up_at + layer.up.numel()].view(layer.up.shape[0], -1)
        layers[key] = LoraLayer(down=down, up=up, scale=layer.scale)
    return BoundAdapter(bound.adapter_id, layers, bound.base_models, flat)


def bind_adapter(parsed: ParsedAdapter, model: ModelLayers, max_rank: int = 1024,
                 dtype: torch.dtype | None = None) -> BoundAdapter:
    """Check every layer of `parsed` against `model`, raising on the first misfit, and
    pack its factors into one pageable host buffer of `dtype` (the adapter cache pins it
    later, off the request's path)."""
    layers = {}
    aid = parsed.adapter_id
    for component, modules in parsed.layers.items():
        if component not in model.component_modules:
            raise AdapterIncompatible(aid, f"it targets the {component}, which this model does not have",
                                      "Use an adapter made for this base model")
        for name, layer in modules.items():
            module = model.modules.get((component, name))
            if module is None:
                raise AdapterIncompatible(aid, f"layer '{component}.{name}' does not exist in this model",
                                          "Use an adapter trained on this base model")
            _check_layer(aid, f"{component}.{name}", module, layer, max_rank)
            layers[(component, name)] = layer
    if not layers:
        raise AdapterInvalid(aid, "it touches no layer of this model", "Use an adapter for this base model")
    bound = BoundAdapter(aid, layers, tuple(parsed.base_models)).to("cpu", dtype)
    _refuse_non_finite(bound, dtype)
    return bound


def _refuse_non_finite(bound: BoundAdapter, dtype: torch.dtype | None) -> None:
    low, high = torch.aminmax(bound.packed)  # one pass (NaN propagates); then find the layer to name it
    if torch.isfinite(low) and torch.isfinite(high):
        return
    where = next(f"{c}.{n}" for (c, n), layer in bound.layers.items()
                 if not (torch.isfinite(layer.down).all() and torch.isfinite(layer.up).all()))
    raise AdapterInvalid(bound.adapter_id, f"layer '{where}' has NaN or infinite values"
                         f"{' in ' + str(dtype).removeprefix('torch.') if dtype else ''}",
                         "The adapter is corrupt (or overflows the model's dtype): train or export it again")


def _check_layer(aid: str, where: str, module: nn.Module, layer: LoraLayer, max_rank: int) -> None:
    weight = module.weight
    down, up = layer.down, layer.up
    if not (down.is_floating_point() and up.is_floating_point()):
        raise AdapterInvalid(aid, f"layer '{where}' has non-float weights ({down.dtype})",
                             "Export the adapter in float16, bfloat16 or float32")
    rank = layer.rank
    if isinstance(module, nn.Linear):
        fits = down.shape == (rank, weight.shape[1]) and up.shape == (weight.shape[0], rank)
    else:
        if module.groups != 1:
            raise AdapterIncompatible(aid, f"layer '{where}' is a grouped convolution",
                                      "Remove that layer from the adapter")
        fits = down.shape == (rank, *weight.shape[1:]) and up.shape in ((weight.shape[0], rank, 1, 1),
                                                                          (weight.shape[0], rank))
    if down.ndim == 0 or not fits:
        raise AdapterIncompatible(
            aid, f"layer '{where}' has A {tuple(down.shape)} and B {tuple(up.shape)}, which do not fit its "
            f"weight {tuple(weight.shape)}", "Use an adapter trained on this base model")
    if rank > max_rank:
        raise AdapterInvalid(aid, f"layer '{where}' has rank {rank}, over the limit of {max_rank}",
                             "Use a lower-rank adapter or raise --max-rank")
    if not math.isfinite(layer.scale):
        raise AdapterInvalid(aid, f"layer '{where}' has a NaN or infinite alpha",
                             "The adapter is corrupt: train or export it again")
