"""The fused swap: adapters written into the base weights in place, from pristine copies.

For every weight an adapter touches, a pristine copy of the base weight is kept. To
apply adapters {(A_i, B_i, scale_i, weight_i)}: write W = pristine + weight * scale *
B @ A for every touched weight (one pass over the weight on CUDA, see `kernels`), and
copy back the weights only the previous adapters touched. Modules never change and
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
from .kernels import float8_kernel_available, fuse_into, kernel_available, requantize_into, warm_up, warm_up_float8

logger = logging.getLogger(__name__)

LayerKey = tuple[str, str]  # (component, module name)
_CHUNK_BYTES = 16 * 2**20  # host-to-GPU copies are split so fusing starts before the copy ends


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
            spans = _packed_spans(self.layers.values())
            # written once: each factor copied in, only the alignment padding between them zeroed
            flat = torch.empty(spans[-1][-1] if spans else 0, dtype=dtype, device=device,
                               pin_memory=pin_memory and device.type == "cpu")
            for layer, (down_at, up_at, end) in zip(self.layers.values(), spans):
                down_end, up_end = down_at + layer.down.numel(), up_at + layer.up.numel()
                flat[down_at: down_end].copy_(layer.down.reshape(-1), non_blocking=non_blocking)
                flat[up_at: up_end].copy_(layer.up.reshape(-1), non_blocking=non_blocking)
                if up_at > down_end:
                    flat[down_end: up_at].zero_()
                if end > up_end:
                    flat[up_end: end].zero_()
        return _with_buffer(self, flat)


_ALIGN = 8  # elements: every factor starts 16-byte aligned (bf16), so the swap kernel's loads are vectorized


def _packed_spans(layers) -> list[tuple[int, int, int]]:
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


def _with_buffer(bound: BoundAdapter, flat: torch.Tensor) -> BoundAdapter:
    """`bound` with its factors as 2-D views into `flat` (packed in layer order: down, up).

    Down is viewed [rank, fan_in] and up [out, rank], conv factors included: the shapes
    `addmm` takes, so a swap reshapes nothing."""
    layers = {}
    for (key, layer), (down_at, up_at, _) in zip(bound.layers.items(), _packed_spans(bound.layers.values())):
        down = flat[down_at: down_at + layer.down.numel()].view(layer.down.shape[0], -1)
        up = flat[up_at: up_at + layer.up.numel()].view(layer.up.shape[0], -1)
        layers[key] = LoraLayer(down=down, up=up, scale=layer.scale)
    return BoundAdapter(bound.adapter_id, layers, bound.base_models, flat)


class FusedSwapper:
    """Owns the LoRA state of one model's weights: what is applied, and the pristine copies."""

    def __init__(self, components: dict[str, nn.Module], pristine: Literal["device", "host"] = "device",
                 max_rank: int = 1024, kernel: bool = True):
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
        self._copy_stream = None
        self._views: dict[LayerKey, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self.kernel = kernel  # the one-pass kernel on the layers it runs on (CUDA + Triton); else `addmm`
        self.float8_kernel = kernel  # float8 weights' re-quantization kernel (CUDA 8.9+); else eager ops
        self._fp8: dict[LayerKey, Fp8Weight] = {}  # float8 weights (`--quantize`), also in `_pristine`

    # ---------------------------------------------------------------- binding
    def bind(self, parsed: ParsedAdapter, base_models: Sequence[str] = (),
             dtype: torch.dtype | None = None) -> BoundAdapter:
        """Check every layer of `parsed` against this model, raising on the first misfit,
        and pack its factors into one pageable host buffer of `dtype` (the adapter cache
        pins it later, off the request's path)."""
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
        bound = BoundAdapter(aid, layers, tuple(base_models)).to("cpu", dtype)
        low, high = torch.aminmax(bound.packed)  # one pass (NaN propagates); then find the layer to name it
        if not (torch.isfinite(low) and torch.isfinite(high)):
            where = next(f"{c}.{n}" for (c, n), layer in bound.layers.items()
                         if not (torch.isfinite(layer.down).all() and torch.isfinite(layer.up).all()))
            raise AdapterInvalid(aid, f"layer '{where}' has NaN or infinite values"
                                 f"{' in ' + str(dtype).removeprefix('torch.') if dtype else ''}",
                                 "The adapter is corrupt (or overflows the model's dtype): train or export it again")
        return bound

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
        if not math.isfinite(layer.scale):
            raise AdapterInvalid(aid, f"layer '{where}' has a NaN or infinite alpha",
                                 "The adapter is corrupt: train or export it again")

    # ---------------------------------------------------------------- applying
    @torch.no_grad()
    def apply(self, adapters: Sequence[tuple[BoundAdapter, float]]) -> float:
        """Make the weights base + sum(weight * scale * B @ A); returns seconds taken.

        Weights touched now are written from their pristine copies with one call per layer
        (`kernels.fuse_into`: one pass on CUDA, `addmm` elsewhere), weights touched only
        before are copied back in one batched copy, and factors in pinned host RAM stream
        to the GPU in chunks on a side stream while earlier layers are being fused.
        """
        start = time.perf_counter()
        wanted = {key for bound, _ in adapters for key in bound.layers}
        touched = self._dirty | wanted
        try:
            # 1. weights only the previous adapters touched: back to pristine, one batched copy
            stale = sorted(self._dirty - wanted)
            plain = [k for k in stale if k not in self._fp8]
            if plain:
                torch._foreach_copy_([self._weight(k) for k in plain], [self._pristine[k] for k in plain])
            for key in stale:
                if key in self._fp8:
                    self._fp8[key].restore()
            self._dirty -= set(stale)
            # 2. pristine copies of weights touched for the first time
            for key in wanted - self._pristine.keys():
                self._save_pristine(key, self._weight(key))
            # 3. W = pristine + weight * scale * B @ A (further adapters on the same W: in place).
            #    One call per layer: the loop is launch-bound on models with ~1,000 layers.
            written: set[LayerKey] = set()
            kernel = self.kernel
            fp8_deltas: dict[LayerKey, list] = {}
            for bound, blend in adapters:
                factors, ready = self._on_device(bound)
                stream, last_event = torch.cuda.current_stream() if ready else None, None
                for key, layer in factors.layers.items():
                    event = ready.get(key) if ready else None
                    if event is not None and event is not last_event:
                        stream.wait_event(event)
                        last_event = event
                    if key in self._fp8:  # float8 weights: re-quantized once, with every adapter's delta (4.)
                        fp8_deltas.setdefault(key, []).append((layer.up, layer.down, blend * layer.scale))
                        continue
                    weight, pristine, kernel_runs = self._views[key]
                    alpha = blend * layer.scale
                    if key in written:
                        fuse_into(weight, weight, layer.up, layer.down, alpha, kernel and kernel_runs)
                    elif pristine.device == weight.device:
                        fuse_into(weight, pristine, layer.up, layer.down, alpha, kernel and kernel_runs)
                    else:
                        weight.copy_(pristine, non_blocking=True).addmm_(layer.up, layer.down, alpha=alpha)
                    if len(adapters) > 1:
                        written.add(key)
            # 4. float8 weights: W = quantize(dequantize(pristine) + sum of deltas), in place
            for key, deltas in fp8_deltas.items():
                self._fp8[key].write(deltas, self.float8_kernel)
            self._dirty |= wanted
        except BaseException:
            self._restore(touched)
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def warm_up_kernel(self) -> None:
        """Compile the swap kernels' variants this model's weights need now (no-op where they
        do not run)."""
        if not self.kernel:
            return
        plain: dict[tuple, set[int]] = {}  # (device, dtype) -> row lengths
        float8: dict[tuple, set[int]] = {}  # (device, per tensor, factors' dtype) -> row lengths
        for module in self._modules.values():
            w = module.weight
            if Fp8Weight.holds(w):  # a Float8Tensor's dtype is its factors'
                float8.setdefault((w.qdata.device, w.scale.numel() == 1, w.dtype), set()).add(w.qdata.shape[1])
            else:
                plain.setdefault((w.device, w.dtype), set()).add(w[0].numel())
        try:
            for (device, dtype), lengths in plain.items():
                if kernel_available(torch.empty(0, device=device, dtype=dtype)):
                    warm_up(device, dtype, lengths)
        except Exception:  # an old GPU or no C compiler: swaps still work, through addmm
            logger.warning("the swap kernel does not compile here; swapping with addmm", exc_info=True)
            self.kernel = False
        try:
            for (device, per_tensor, dtype), lengths in float8.items():
                if float8_kernel_available(torch.empty(0, device=device, dtype=torch.float8_e4m3fn)):
                    warm_up_float8(device, per_tensor, lengths, dtype)
        except Exception:
            logger.warning("the float8 swap kernel does not compile here; re-quantizing eagerly", exc_info=True)
            self.float8_kernel = False

    def reset(self) -> None:
        """Back to the base model, bitwise."""
        self.apply(())

    def _weight(self, key: LayerKey) -> torch.Tensor:
        return self._modules[key].weight.data

    def _save_pristine(self, key: LayerKey, weight: torch.Tensor) -> None:
        if Fp8Weight.holds(weight):
            self._fp8[key] = self._pristine[key] = Fp8Weight(weight, on_host=self._pristine_on_host)
            return
        if self._pristine_on_host and weight.is_cuda:
            pristine = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
            pristine.copy_(weight)
        else:
            pristine = weight.clone()
        self._pristine[key] = pristine
        # 2-D views of the weight and its copy, made once: weights never move
        weight2d, pristine2d = weight.view(weight.shape[0], -1), pristine.view(weight.shape[0], -1)
        kernel_runs = (pristine.device == weight.device and kernel_available(weight)
                       and weight2d.is_contiguous() and pristine2d.is_contiguous())
        self._views[key] = (weight2d, pristine2d, kernel_runs)

    def _on_device(self, bound: BoundAdapter) -> tuple[BoundAdapter, dict]:
        """The factors on the model's device and dtype, and per layer the event after which
        they have arrived (empty when nothing is in flight)."""
        key = next(iter(bound.layers))
        weight = self._weight(key)
        layer = bound.layers[key]
        if layer.down.device == weight.device and layer.down.dtype == weight.dtype:
            return bound, {}
        packed = bound.packed
        if not (weight.is_cuda and packed is not None and packed.dtype == weight.dtype and packed.is_pinned()):
            return bound.to(weight.device, weight.dtype, non_blocking=True), {}
        return self._stream_to_device(bound, weight.device)

    def _stream_to_device(self, bound: BoundAdapter, device: torch.device) -> tuple[BoundAdapter, dict]:
        """Copy a pinned packed adapter to the GPU in chunks on a side stream, one event per chunk."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        side, main = self._copy_stream, torch.cuda.current_stream(device)
        flat = torch.empty_like(bound.packed, device=device)
        side.wait_stream(main)  # `flat` was allocated on the main stream
        flat.record_stream(side)  # (even if a later line raises, copies in flight keep it)
        ready, chunk_keys, start = {}, [], 0
        for key, (_, _, offset) in zip(bound.layers, _packed_spans(bound.layers.values())):
            chunk_keys.append(key)
            if (offset - start) * flat.element_size() >= _CHUNK_BYTES or key == next(reversed(bound.layers)):
                with torch.cuda.stream(side):
                    flat[start:offset].copy_(bound.packed[start:offset], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
                ready.update(dict.fromkeys(chunk_keys, event))
                chunk_keys, start = [], offset
        return _with_buffer(bound, flat), ready

    def _restore(self, keys) -> None:
        for key in keys:
            if key in self._fp8:
                self._fp8[key].restore()
            elif key in self._pristine:
                self._weight(key).copy_(self._pristine[key])
        self._dirty.clear()
        logger.warning("swap failed; %d touched weights restored to the base model", len(keys))

    def save_all_pristine(self) -> None:
        """Pristine copies of every weight an adapter may touch, made now rather than on
        first touch: the low-memory mode pins them in host RAM at start-up, which inside a
        request's swap took seconds (2.6-5.4 s for FLUX.1's first adapters on the H200)."""
        for key in sorted(self._modules.keys() - self._pristine.keys()):
            self._save_pristine(key, self._weight(key))

    @property
    def pristine_bytes(self) -> int:
        return sum(t.nbytes for t in self._pristine.values())


class Fp8Weight:
    """A float8 weight (torchao's `Float8Tensor`: `qdata` and its `scale`) and a pristine
    copy of both. An adapter is fused by de-quantizing the copy, adding the deltas in
    fp32 and quantizing again with torchao's own rule, written into `qdata` and `scale` in
    place (compiled code keeps its tensors); `restore` is bitwise. With `on_host` the copy
    lives in pinned host RAM (the low-memory mode) and streams in when needed."""

    def __init__(self, weight: torch.Tensor, on_host: bool = False):
        self.qdata, self.scale = weight.qdata, weight.scale
        if on_host and self.qdata.is_cuda:
            self.pristine_qdata = torch.empty(self.qdata.shape, dtype=self.qdata.dtype, pin_memory=True)
            self.pristine_scale = torch.empty(self.scale.shape, dtype=self.scale.dtype, pin_memory=True)
            self.pristine_qdata.copy_(self.qdata)
            self.pristine_scale.copy_(self.scale)
        else:
            self.pristine_qdata, self.pristine_scale = self.qdata.clone(), self.scale.clone()
        from torchao.quantization import PerRow, PerTensor

        block = list(getattr(weight, "block_size", []))
        if block == [1, self.qdata.shape[-1]]:
            self.granularity = PerRow()
        elif block == list(self.qdata.shape):
            self.granularity = PerTensor()
        else:
            raise ValueError(f"float8 weights with {block} blocks are not supported; quantize per row or tensor")

    @staticmethod
    def holds(weight: torch.Tensor) -> bool:
        return type(weight).__name__ == "Float8Tensor" and hasattr(weight, "qdata") and hasattr(weight, "scale")

    @property
    def nbytes(self) -> int:
        return self.pristine_qdata.nbytes + self.pristine_scale.nbytes

    def restore(self) -> None:
        self.qdata.copy_(self.pristine_qdata, non_blocking=True)
        self.scale.copy_(self.pristine_scale, non_blocking=True)

    def write(self, deltas: list[tuple[torch.Tensor, torch.Tensor, float]], kernel: bool = False) -> None:
        """One adapter through `kernels.requantize_into` where it runs (and `kernel`), two
        passes reading the float8 copy; a blend, or elsewhere, through eager fp32 ops."""
        from torchao.quantization import Float8Tensor

        device = self.qdata.device
        qdata = self.pristine_qdata.to(device, non_blocking=True)
        scale = self.pristine_scale.to(device, non_blocking=True)
        if kernel and len(deltas) == 1 and float8_kernel_available(self.qdata) and self.qdata.is_contiguous():
            up, down, alpha = deltas[0]
            requantize_into(self.qdata, self.scale, qdata, scale, up, down, alpha)
            return
        high = qdata.to(torch.float32) * scale.to(torch.float32)  # [rows, 1] or [1, 1]: broadcast
        for up, down, alpha in deltas:
            high.addmm_(up.to(torch.float32), down.to(torch.float32), alpha=alpha)
        fresh = Float8Tensor.from_hp(high, float8_dtype=self.qdata.dtype, granularity=self.granularity)
        self.qdata.copy_(fresh.qdata)
        self.scale.copy_(fresh.scale.reshape(self.scale.shape))
