"""An adapter bound to one model: every layer checked against the model's parameters, its
factors packed into one flat buffer so it moves between host and GPU in one copy.

`bind_adapter` is where everything that can be checked is checked (layers exist, shapes
fit, ranks under the limit, values finite), before any weight of the model is touched:
the swap itself then only writes.
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loraswap.adapters.files.data import FileData, NotInFile
from loraswap.adapters.files.device_read import DeviceReadFailed, pack_from_files, reading_on
from loraswap.adapters.files.host_memory import host_empty, in_pieces, run_all
from loraswap.adapters.kinds import Layer, delta_shape, dora_magnitude_shape
from loraswap.adapters.parse.changes import ParsedAdapter
from loraswap.errors import AdapterError, AdapterIncompatible, AdapterInvalid

LayerKey = tuple[str, str]  # (component, parameter name), e.g. ("unet", "conv_in.weight")

_ALIGN = 8  # elements: every factor starts 16-byte aligned (bf16), so the swap kernel's loads are vectorized


class ModelLayers:
    """The parameters of a model that adapters may change: every parameter of the
    components adapters target (the denoiser, the text encoders)."""

    def __init__(self, components: dict[str, nn.Module]):
        self.params: dict[LayerKey, nn.Parameter] = {
            (component, name): param for component, root in components.items()
            for name, param in root.named_parameters()
        }
        self.component_modules = {c: {n for n, _ in root.named_modules() if n} for c, root in components.items()}


@dataclass(frozen=True)
class BoundAdapter:
    """An adapter checked against one model: every parameter exists and every shape fits.

    `packed` is set when all factors are views into one flat buffer (see `to`), so the
    adapter moves between host and GPU in a single copy.
    """

    adapter_id: str
    layers: dict[LayerKey, Layer]
    base_models: tuple[str, ...] = ()
    packed: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return sum(layer.nbytes for layer in self.layers.values())

    @property
    def device(self) -> torch.device:
        return _first_factor(self).device

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    def kinds(self) -> list[str]:
        """The kinds of change it makes, e.g. ["lora", "loha+dora", "bias"]."""
        return sorted({layer.label(p) for (_, p), layer in self.layers.items()})

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None, pin_memory: bool = False,
           non_blocking: bool = False, files: Sequence[FileData] = ()) -> "BoundAdapter":
        """A copy whose factors live in one flat buffer on `device` (pinned host RAM if asked).

        From a packed adapter of the same dtype this is one copy (asynchronous from
        pinned memory with `non_blocking`); otherwise the factors are packed first, those
        standing in for bytes of `files` (an adapter read in place) read from them.
        """
        device = torch.device(device)
        dtype = dtype or _first_factor(self).dtype
        if self.packed is not None and self.packed.dtype == dtype:
            flat = self.packed.to(device, non_blocking=non_blocking) if not pin_memory else _pinned(self.packed)
        else:
            flat = self._pack(device, dtype, pin_memory and device.type == "cpu", non_blocking, files)
        return with_buffer(self, flat)

    def _pack(self, device: torch.device, dtype: torch.dtype, pin_memory: bool, non_blocking: bool,
              files: Sequence[FileData]) -> torch.Tensor:
        layers = list(self.layers.values())
        spans = packed_spans(layers)
        numel = spans[-1][-1] if spans else 0
        if device.type != "cpu" and files:  # a new adapter's factors cut out of its file on the device
            return pack_on_device(layers, spans, dtype, device, files)
        if device.type == "cpu" and not pin_memory:  # a new adapter's host copy: written once, on huge pages
            flat = host_empty(numel, dtype)
        else:
            flat = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin_memory)

        def fill(first: int, last: int) -> None:  # layers[first:last]: each factor copied in, the padding zeroed
            start = spans[first - 1][1] if first else 0
            for layer, (starts, end) in zip(layers[first:last], spans[first:last]):
                for tensor, at in zip(layer.factors.values(), starts):
                    if at > start:
                        flat[start: at].zero_()
                    if tensor.is_meta:  # read in place: the file's bytes go straight to their place
                        _from_file(tensor, flat[at: at + tensor.numel()], files)
                    else:
                        flat[at: at + tensor.numel()].copy_(tensor.reshape(-1), non_blocking=non_blocking)
                    start = at + tensor.numel()
                if end > start:
                    flat[start: end].zero_()
                start = end

        # on the host in pieces on several threads; a device copy stays on this thread's stream
        pieces = in_pieces(flat.nbytes) if device.type == "cpu" else 1
        run_all([functools.partial(fill, first, last) for first, last in _runs(spans, pieces)])
        return flat


def pack_on_device(layers: list[Layer], spans: list[tuple[list[int], int]], dtype: torch.dtype,
                   device: torch.device, files: Sequence[FileData]) -> torch.Tensor:
    """A new adapter's cold read to `device`: the layers' factors cut out of `files` there and
    packed at `spans` (`packed_spans`) in `dtype`, as `BoundAdapter.to` packs them on the host.
    The parse's `NotInFile` and an adapter's own refusal pass through; any other failure (out
    of GPU memory, say) is `DeviceReadFailed`, for the caller to read it on the host instead."""
    factors = [t for layer in layers for t in layer.factors.values()]
    try:  # (on the read stream: `files` come only from `bind_adapter`, which reads there)
        return pack_from_files(factors, [at for starts, _ in spans for at in starts], spans[-1][1], dtype, device,
                               files)
    except (NotInFile, AdapterError):
        raise
    except Exception as e:  # out of GPU memory, say: told apart from the parse's own fallbacks
        raise DeviceReadFailed(f"{type(e).__name__}: {e}") from e


def _pinned(packed: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `packed` (from the host or from the GPU)."""
    if not packed.is_cuda:
        return packed.pin_memory()
    return torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed)


def _from_file(tensor: torch.Tensor, out: torch.Tensor, files: Sequence[FileData]) -> None:
    file = next((f for f in files if f.owns(tensor)), None)
    if file is None:
        raise NotInFile("a factor computed from the file's tensors, not cut out of one")
    file.read_into(tensor, out)


def _runs(spans: list[tuple[list[int], int]], pieces: int) -> list[tuple[int, int]]:
    """`spans` cut into at most `pieces` runs of layers of about equal size, as (first, last)."""
    total, runs, first = (spans[-1][1] if spans else 0), [], 0
    for i, (_, end) in enumerate(spans):
        if end * pieces >= total * (len(runs) + 1) or i == len(spans) - 1:
            runs.append((first, i + 1))
            first = i + 1
    return runs


def _first_factor(bound: BoundAdapter) -> torch.Tensor:
    return next(iter(next(iter(bound.layers.values())).factors.values()))


def packed_spans(layers) -> list[tuple[list[int], int]]:
    """Per layer, where each of its factors starts in the packed buffer and where the
    layer's span ends (padded so the next factor starts aligned)."""
    spans, offset = [], 0
    align = lambda n: -(-n // _ALIGN) * _ALIGN  # noqa: E731
    for layer in layers:
        starts = []
        for tensor in layer.factors.values():
            starts.append(offset)
            offset = align(offset + tensor.numel())
        spans.append((starts, offset))
    return spans


def with_buffer(bound: BoundAdapter, flat: torch.Tensor) -> BoundAdapter:
    """`bound` with its factors as views into `flat` (packed in layer and factor order).

    The factors a kind's write takes as matrices (`AdapterKind.matrix_factors`: a LoRA's down
    [rank, fan_in] and up [out, rank], conv factors included) are viewed that way: a swap
    then reshapes nothing."""
    layers = {}
    for (key, layer), (starts, _) in zip(bound.layers.items(), packed_spans(bound.layers.values())):
        factors, matrices = {}, layer.kind.matrix_factors(layer.factors)
        for (name, tensor), at in zip(layer.factors.items(), starts):
            view = flat[at: at + tensor.numel()]
            factors[name] = view.view(tensor.shape[0], -1) if name in matrices else view.view(tensor.shape)
        layers[key] = layer.replace(factors=factors)
    return BoundAdapter(bound.adapter_id, layers, bound.base_models, flat)


def bind_adapter(parsed: ParsedAdapter, model: ModelLayers, max_rank: int = 1024,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> BoundAdapter:
    """Check every layer of `parsed` against `model`, raising on the first misfit, and
    pack its factors into one buffer of `dtype`: pageable host memory (the adapter cache
    pins it later, off the request's path), or on `device` when the file was read in place
    (`device_read`: the bytes go to the GPU once; the cache copies them down later). Read
    whole, an adapter is packed on the host whatever `device` is."""
    layers = fitted_layers(parsed, model, max_rank)
    where = torch.device(device if parsed.files else "cpu")
    with reading_on(where):  # on CUDA a side stream: the read waits for none of the GPU worker's kernels
        bound = BoundAdapter(parsed.adapter_id, layers, tuple(parsed.base_models)).to(where, dtype,
                                                                                      files=parsed.files)
        _refuse_non_finite(bound, dtype)
    return bound


def fitted_layers(parsed: ParsedAdapter, model: ModelLayers, max_rank: int = 1024) -> dict[LayerKey, Layer]:
    """`parsed`'s layers, each checked against the model parameter it changes (which must
    exist, its change fit the parameter's shape, its rank the limit); the first misfit raises.
    Shapes only: an adapter read in place is checked without reading its factors."""
    layers = {}
    aid = parsed.adapter_id
    for component, params in parsed.layers.items():
        if component not in model.component_modules:
            raise AdapterIncompatible(aid, f"it targets the {component}, which this model does not have",
                                      "Use an adapter made for this base model")
        for name, layer in params.items():
            param = model.params.get((component, name))
            if param is None:
                raise AdapterIncompatible(aid, f"parameter '{component}.{name}' does not exist in this model",
                                          "Use an adapter trained on this base model")
            _check_layer(aid, f"{component}.{name}", param, layer, max_rank)
            layers[(component, name)] = layer.replace(shape=tuple(param.shape))
    if not layers:
        raise AdapterInvalid(aid, "it touches no layer of this model", "Use an adapter for this base model")
    return layers


def _refuse_non_finite(bound: BoundAdapter, dtype: torch.dtype | None) -> None:
    low, high = torch.aminmax(bound.packed)  # one pass (NaN propagates); then find the layer to name it
    if torch.isfinite(low) and torch.isfinite(high):
        return
    where = next(f"{c}.{n}" for (c, n), layer in bound.layers.items()
                 if not all(torch.isfinite(t).all() for t in layer.factors.values()))
    raise AdapterInvalid(bound.adapter_id, f"layer '{where}' has NaN or infinite values"
                         f"{' in ' + str(dtype).removeprefix('torch.') if dtype else ''}",
                         "The adapter is corrupt (or overflows the model's dtype): train or export it again")


def _check_layer(aid: str, where: str, param: torch.Tensor, layer: Layer, max_rank: int) -> None:
    if not all(t.is_floating_point() for t in layer.factors.values()):
        raise AdapterInvalid(aid, f"layer '{where}' has non-float weights",
                             "Export the adapter in float16, bfloat16 or float32")
    shape, change = tuple(param.shape), delta_shape(layer)
    # a conv change may come flattened ([out, in * kh * kw], as LoHa and LoKr store it)
    if change != shape and not (change[0] == shape[0] and math.prod(change) == math.prod(shape) and len(shape) > 2):
        raise AdapterIncompatible(aid, f"layer '{where}' has {layer.kind.name} factors ({_factor_shapes(layer)}), "
                                  f"which do not fit its weight {shape} (they make {change})",
                                  "Use an adapter trained on this base model")
    if layer.dora is not None:
        expected = dora_magnitude_shape(layer.dora, shape)
        if math.prod(layer.factors["magnitude"].shape) != math.prod(expected):
            raise AdapterIncompatible(aid, f"layer '{where}' has a DoRA magnitude of shape "
                                      f"{tuple(layer.factors['magnitude'].shape)}; its weight {shape} needs {expected}",
                                      "Use an adapter trained on this base model")
    if layer.rank > max_rank:
        raise AdapterInvalid(aid, f"layer '{where}' has rank {layer.rank}, over the limit of {max_rank}",
                             "Use a lower-rank adapter or raise --max-rank")
    if not math.isfinite(layer.scale):
        raise AdapterInvalid(aid, f"layer '{where}' has a NaN or infinite alpha",
                             "The adapter is corrupt: train or export it again")


def _factor_shapes(layer: Layer) -> str:
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in layer.factors.items())
