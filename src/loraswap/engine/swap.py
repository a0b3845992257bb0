"""The fused swap: adapters written into the base weights in place, from pristine copies.

For every weight an adapter touches, a pristine copy of the base weight is kept. To
apply adapters {(A_i, B_i, scale_i, weight_i)}: restore the touched weights from
their copies, then `W.addmm_(B, A, alpha=weight * scale)`. Modules never change and
weight tensors never move, so a compiled model stays valid: any rank, any target set,
several adapters blended, text encoders too, no per-step cost, and an exact (bitwise)
return to the base model.

Everything that can be checked is checked in `bind`, before any weight is touched; if
`apply` still fails halfway (out of memory, say), every touched weight is restored
from its pristine copy before the error propagates, so the model is the base model.
"""

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..adapters.formats import LoraLayer, ParsedAdapter
from ..errors import AdapterIncompatible, AdapterInvalid

logger = logging.getLogger(__name__)

LayerKey = tuple[str, str]  # (component, module name)


@dataclass(frozen=True)
class BoundAdapter:
    """An adapter checked against one model: every layer exists and every shape fits."""

    adapter_id: str
    layers: dict[LayerKey, LoraLayer]
    base_models: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())


class FusedSwapper:
    """Owns the LoRA state of one model's weights: what is applied, and the pristine copies."""

    def __init__(self, components: dict[str, nn.Module], pristine: Literal["device", "host"] = "device",
                 max_rank: int = 1024):
        self._modules: dict[LayerKey, nn.Module] = {
            (component, name): module
            for component, root in components.items()
            for name, module in root.named_modules()
            if isinstance(module, (nn.Linear, nn.Conv2d))
        }
        self.component_modules = {c: {n for (cc, n) in self._modules if cc == c} for c in components}
        self._pristine_on_host = pristine == "host"
        self.max_rank = max_rank
        self._pristine: dict[LayerKey, torch.Tensor] = {}
        self._dirty: set[LayerKey] = set()
        self.applied: tuple[tuple[BoundAdapter, float], ...] = ()

    # ---------------------------------------------------------------- binding
    def bind(self, parsed: ParsedAdapter, base_models: Sequence[str] = ()) -> BoundAdapter:
        """Check every layer of `parsed` against this model; raise naming the first misfit."""
        layers = {}
        aid = parsed.adapter_id
        for component, modules in parsed.layers.items():
            if component not in self.component_modules:
                raise AdapterIncompatible(aid, f"it targets the {component}, which this model does not have",
                                          "Use an adapter made for this base model")
            for name, layer in modules.items():
                key = (component, name)
                module = self._modules.get(key)
                if module is None:
                    raise AdapterIncompatible(aid, f"layer '{component}.{name}' does not exist in this model",
                                              "Use an adapter trained on this base model")
                self._check_layer(aid, f"{component}.{name}", module, layer)
                layers[key] = layer
        if not layers:
            raise AdapterInvalid(aid, "it touches no layer of this model", "Use an adapter for this base model")
        return BoundAdapter(aid, layers, tuple(base_models))

    def _check_layer(self, aid: str, where: str, module: nn.Module, layer: LoraLayer) -> None:
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
        if rank > self.max_rank:
            raise AdapterInvalid(aid, f"layer '{where}' has rank {rank}, over the limit of {self.max_rank}",
                                 "Use a lower-rank adapter or raise --max-rank")
        if not (math.isfinite(layer.scale) and torch.isfinite(down).all() and torch.isfinite(up).all()):
            raise AdapterInvalid(aid, f"layer '{where}' has NaN or infinite values",
                                 "The adapter is corrupt: train or export it again")

    # ---------------------------------------------------------------- applying
    @torch.no_grad()
    def apply(self, adapters: Sequence[tuple[BoundAdapter, float]]) -> float:
        """Make the weights base + sum(weight * scale * B @ A); returns seconds taken."""
        start = time.perf_counter()
        wanted: dict[LayerKey, list[tuple[LoraLayer, float]]] = {}
        for bound, blend in adapters:
            for key, layer in bound.layers.items():
                wanted.setdefault(key, []).append((layer, blend))
        touched = self._dirty | wanted.keys()
        try:
            for key in self._dirty - wanted.keys():
                self._weight(key).copy_(self._pristine[key], non_blocking=True)
                self._dirty.discard(key)
            for key, contributions in wanted.items():
                weight = self._weight(key)
                self._save_or_restore(key, weight)
                self._dirty.add(key)
                flat = weight.view(weight.shape[0], -1)
                for layer, blend in contributions:
                    up = layer.up.to(weight.device, weight.dtype, non_blocking=True).reshape(weight.shape[0], -1)
                    down = layer.down.to(weight.device, weight.dtype, non_blocking=True).reshape(layer.rank, -1)
                    flat.addmm_(up, down, alpha=blend * layer.scale)
        except BaseException:
            self._restore(touched)
            raise
        self.applied = tuple(adapters)
        if adapters and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def reset(self) -> None:
        """Back to the base model, bitwise."""
        self.apply(())

    def _weight(self, key: LayerKey) -> torch.Tensor:
        return self._modules[key].weight.data

    def _save_or_restore(self, key: LayerKey, weight: torch.Tensor) -> None:
        pristine = self._pristine.get(key)
        if pristine is None:
            if self._pristine_on_host and weight.is_cuda:
                pristine = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
                pristine.copy_(weight)
            else:
                pristine = weight.clone()
            self._pristine[key] = pristine
        elif key in self._dirty:
            weight.copy_(pristine, non_blocking=True)

    def _restore(self, keys) -> None:
        for key in keys:
            if key in self._pristine:
                self._weight(key).copy_(self._pristine[key])
        self._dirty.clear()
        self.applied = ()
        logger.warning("swap failed; %d touched weights restored to the base model", len(keys))

    @property
    def applied_ids(self) -> tuple[tuple[str, float], ...]:
        return tuple((bound.adapter_id, blend) for bound, blend in self.applied)

    @property
    def pristine_bytes(self) -> int:
        return sum(t.nbytes for t in self._pristine.values())
