"""The fused swap: adapters written into the base weights in place, from pristine copies.

For every weight an adapter touches, a pristine copy of the base weight is kept. To
apply adapters {(A_i, B_i, scale_i, weight_i)}: write W = pristine + weight * scale *
B @ A for every touched weight (one pass over the weight on CUDA, see `kernels`), and
copy back the weights only the previous adapters touched. Modules never change and
weight tensors never move, so a compiled model stays valid: any rank, any target set,
several adapters blended, text encoders too, no per-step cost, and an exact (bitwise)
return to the base model.

Everything that can be checked is checked when the adapter is bound
(`adapters.bound.bind_adapter`), before any weight is touched; if
`apply` still fails halfway (out of memory, say), every touched weight is restored
from its pristine copy before the error propagates, so the model is the base model.
"""

import logging
import time
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from torch import nn

from loraswap.adapters import kinds
from loraswap.adapters.bound import BoundAdapter, LayerKey, ModelLayers, packed_spans, with_buffer
from loraswap.adapters.cache import CacheEntry
from loraswap.adapters.store import AdapterStore
from loraswap.engine.kernels.by_kind import KIND_KERNELS
from loraswap.engine.kernels.float8 import float8_kernel_available
from loraswap.engine.kernels.float8_warm_up import warm_up_float8
from loraswap.engine.kernels.fused import fuse_dora_into, kernel_available, warm_up
from loraswap.engine.swap.float8_weights import Fp8Weight

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 16 * 2**20  # host-to-GPU copies are split so fusing starts before the copy ends


class Swapper(Protocol):
    """How adapters get into the model's weights: the fused swap here, or a baseline of
    `baselines.py`. The engine drives any of them the same way."""

    compiles: bool  # a compiled model stays valid across its swaps

    @classmethod
    def for_engine(cls, pipeline, layers: ModelLayers, config) -> "Swapper":
        """The swapper of an engine's pipeline (`layers`: its targetable layers; `config`: its
        `EngineConfig`)."""

    def lender(self, store: AdapterStore):
        """Where the engine's leases come from: the store (adapters read, checked and cached),
        or what the swapper takes instead (a baseline's files)."""

    def check(self, adapters: Sequence) -> None:
        """Refuse, changing nothing, what `apply` could not apply."""

    def prepare_to_compile(self) -> None:
        """Set up what the compiled graphs must see."""

    def warm_up(self) -> bool:
        """Compile what swaps need; whether there was anything to warm."""

    def apply(self, adapters: Sequence) -> float:
        """Apply exactly these (held adapter, weight) pairs, as the lender leased them, in place
        of those applied before; seconds taken. On failure the model is the base model."""

    def restore_base(self) -> None:
        """Back to the base model: no adapter applied."""


class FusedSwapper:
    """Owns the LoRA state of one model's weights: what is applied, and the pristine copies."""

    compiles = True  # modules never change: a compiled model stays valid

    def __init__(self, components: dict[str, nn.Module] | ModelLayers, pristine: Literal["device", "host"] = "device",
                 kernel: bool = True):
        self.layers = components if isinstance(components, ModelLayers) else ModelLayers(components)
        self._params = self.layers.params
        self.component_modules = self.layers.component_modules
        self._pristine_on_host = pristine == "host"
        self._pristine: dict[LayerKey, torch.Tensor] = {}
        self._dirty: set[LayerKey] = set()
        self._copy_stream = None
        self._views: dict[LayerKey, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self.kernel = kernel  # the one-pass kernel on the layers it runs on (CUDA + Triton); else `addmm`
        self.float8_kernel = kernel  # float8 weights' re-quantization kernel (CUDA 8.9+); else eager ops
        self._fp8: dict[LayerKey, Fp8Weight] = {}  # float8 weights (`--quantize`), also in `_pristine`

    # ---------------------------------------------------------------- the swapper interface
    def check(self, adapters: Sequence[tuple[CacheEntry, float]]) -> None:
        """Nothing more: everything was checked when the adapters were bound."""

    def lender(self, store: AdapterStore) -> AdapterStore:
        """The store: it reads, checks and caches adapters for this swapper."""
        return store

    @classmethod
    def for_engine(cls, pipeline, layers: ModelLayers, config) -> "FusedSwapper":
        """The engine's fused swapper (`config`: its `EngineConfig`). The low-memory mode
        pins every pristine copy in host RAM now, not inside the first requests' swaps."""
        swapper = cls(layers, pristine=config.memory.pristine)
        if config.memory.pristine == "host":
            pinning = time.perf_counter()
            swapper.save_all_pristine(pipeline._lora_loadable_modules)
            logger.info("pristine copies in host RAM: %.2f GiB in %.1f s", swapper.pristine_bytes / 2**30,
                        time.perf_counter() - pinning)
        return swapper

    def prepare_to_compile(self) -> None:
        """Nothing: the fused swap never changes a module, so it compiles as the base model."""

    def warm_up(self) -> bool:
        self.warm_up_kernel()
        return self.kernel

    # ---------------------------------------------------------------- applying
    @torch.no_grad()
    def apply(self, adapters: Sequence[tuple[BoundAdapter | CacheEntry, float]]) -> float:
        """Make the weights base + sum(weight * scale * B @ A); returns seconds taken. Each
        adapter is bound, or a cache entry as the store leases it (its GPU copy when it has one).

        Weights touched now are written from their pristine copies with one call per layer
        (`kernels.fuse_into`: one pass on CUDA, `addmm` elsewhere), weights touched only
        before are copied back in one batched copy, and factors in pinned host RAM stream
        to the GPU in chunks on a side stream while earlier layers are being fused.
        """
        adapters = [(held.best() if isinstance(held, CacheEntry) else held, weight) for held, weight in adapters]
        start = time.perf_counter()
        wanted = {key for bound, _ in adapters for key in bound.layers}
        touched = self._dirty | wanted
        try:
            # 1. weights only the previous adapters touched: back to pristine
            self._restore_stale(sorted(self._dirty - wanted))
            # 2. pristine copies of weights touched for the first time
            for key in wanted - self._pristine.keys():
                self._save_pristine(key, self._weight(key))
            # 3. W = pristine + weight * scale * B @ A; float8 weights collect their deltas
            fp8_deltas = self._write(adapters)
            # 4. float8 weights: W = quantize(dequantize(pristine) + sum of deltas), in place
            for key, deltas in fp8_deltas.items():
                self._fp8[key].write(deltas, self.float8_kernel)
            self._dirty |= wanted
        except BaseException:
            self._restore(touched)
            raise
        if torch.cuda.is_available():  # this stream only: not the cold reads' and the cache's side streams
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - start

    def _restore_stale(self, stale: list[LayerKey]) -> None:
        """Weights no adapter touches any more back to pristine: plain ones in one batched copy."""
        plain = [k for k in stale if k not in self._fp8]
        if plain:
            torch._foreach_copy_([self._weight(k) for k in plain], [self._pristine[k] for k in plain])
        for key in stale:
            if key in self._fp8:
                self._fp8[key].restore()
        self._dirty -= set(stale)

    def _write(self, adapters: Sequence[tuple[BoundAdapter, float]]) -> dict[LayerKey, list]:
        """Fuse every plain weight's layers (one call per layer: the loop is launch-bound on
        models with ~1,000 layers; further adapters on the same W change what the earlier
        ones wrote, in order); the float8 weights' changes are returned, to be re-quantized
        once with all of them."""
        written: set[LayerKey] = set()
        fp8_deltas: dict[LayerKey, list] = {}
        for bound, blend in adapters:
            factors, ready = self._on_device(bound)
            stream, last_event = torch.cuda.current_stream() if ready else None, None
            for key, layer in factors.layers.items():
                event = ready.get(key) if ready else None
                if event is not None and event is not last_event:
                    stream.wait_event(event)
                    last_event = event
                if key in self._fp8:
                    fp8_deltas.setdefault(key, []).append((layer, blend))
                    continue
                self._fuse_layer(key, layer, blend, in_place=key in written)
                if len(adapters) > 1:
                    written.add(key)
        return fp8_deltas

    def _fuse_layer(self, key: LayerKey, layer: kinds.Layer, blend: float, in_place: bool) -> None:
        """W = source + blend * dW (source: the pristine copy, or W itself in a blend); DoRA
        then rescales W in place."""
        if layer.dora is None:
            self._write_change(key, layer, blend, in_place)
            return
        change = layer.without_dora()
        weight, pristine, kernel_runs = self._views[key]
        by_row = layer.dora != "lycoris-in"
        if change.plain and self.kernel and kernel_runs and (by_row or self._weight(key).ndim == 2):
            source = weight if in_place else pristine
            alpha = kinds.dora_change_weight(layer, blend) * layer.scale
            fuse_dora_into(weight, source, layer.up, layer.down, alpha, layer.factors["magnitude"].reshape(-1), blend,
                           layer.dora == "peft", by_row)
            return
        self._write_change(key, change, kinds.dora_change_weight(layer, blend), in_place)
        kinds.rescale_dora(self._weight(key), layer, blend)

    def _write_change(self, key: LayerKey, layer: kinds.Layer, blend: float, in_place: bool) -> None:
        """The kind's one-pass kernel where it has one (`AdapterKind.fast_write`) and it runs;
        else `kinds.write_change`."""
        weight, pristine, kernel_runs = self._views[key]
        if not in_place and pristine.device != weight.device:  # low-memory mode: the copy streams in first
            weight.copy_(pristine, non_blocking=True)
            in_place = True
        source = weight if in_place else pristine
        fast = layer.kind.fast_write(layer.factors)
        if fast is not None and KIND_KERNELS[fast.kernel](weight, source, fast.operands, blend * layer.scale,
                                                          self.kernel and kernel_runs):
            return
        target = self._weight(key)
        kinds.write_change(target, target if in_place else self._pristine[key], layer, blend)

    def warm_up_kernel(self) -> None:
        """Compile the swap kernels' variants this model's weights need now (no-op where they
        do not run)."""
        if not self.kernel:
            return
        plain, float8 = self._kernel_weight_sizes()
        try:
            for (device, dtype), lengths in plain.items():
                if kernel_available(torch.empty(0, device=device, dtype=dtype)):
                    warm_up(device, dtype, lengths)
        except Exception:  # an old GPU or no C compiler: swaps still work, through addmm
            logger.warning("the swap kernel does not compile here; swapping with addmm", exc_info=True)
            self.kernel = False
        try:
            for (device, per_tensor, dtype), shapes in float8.items():
                if float8_kernel_available(torch.empty(0, device=device, dtype=torch.float8_e4m3fn)):
                    warm_up_float8(device, per_tensor, shapes, dtype)
        except Exception:
            logger.warning("the float8 swap kernel does not compile here; re-quantizing eagerly", exc_info=True)
            self.float8_kernel = False

    def _kernel_weight_sizes(self) -> tuple[dict[tuple, set[int]], dict[tuple, set[tuple[int, int]]]]:
        """The row lengths of the plain weights the kernels write by (device, dtype), and the
        shapes of the float8 ones by (device, per tensor, factors' dtype)."""
        plain: dict[tuple, set[int]] = {}
        float8: dict[tuple, set[tuple[int, int]]] = {}
        for w in self._params.values():
            if w.ndim < 2:  # biases and norms: written by `kinds.write`, not the kernel
                continue
            if Fp8Weight.holds(w):  # a Float8Tensor's dtype is its factors'
                float8.setdefault((w.qdata.device, w.scale.numel() == 1, w.dtype), set()).add(tuple(w.qdata.shape))
            else:
                plain.setdefault((w.device, w.dtype), set()).add(w[0].numel())
        return plain, float8

    def restore_base(self) -> None:
        """Back to the base model, bitwise."""
        self.apply(())

    def _weight(self, key: LayerKey) -> torch.Tensor:
        return self._params[key].data

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
        factor = next(iter(bound.layers[key].factors.values()))
        if factor.device == weight.device and factor.dtype == weight.dtype:
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
        for key, (_, offset) in zip(bound.layers, packed_spans(bound.layers.values())):
            chunk_keys.append(key)
            if (offset - start) * flat.element_size() >= _CHUNK_BYTES or key == next(reversed(bound.layers)):
                with torch.cuda.stream(side):
                    flat[start:offset].copy_(bound.packed[start:offset], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
                ready.update(dict.fromkeys(chunk_keys, event))
                chunk_keys, start = [], offset
        return with_buffer(bound, flat), ready

    def _restore(self, keys) -> None:
        for key in keys:
            if key in self._fp8:
                self._fp8[key].restore()
            elif key in self._pristine:
                self._weight(key).copy_(self._pristine[key])
        self._dirty.clear()
        logger.warning("swap failed; %d touched weights restored to the base model", len(keys))

    def save_all_pristine(self, components=None) -> None:
        """Pristine copies of the weights LoRAs touch (every matrix and conv kernel of
        `components`, default all), made now rather than on first touch: the low-memory mode
        pins them in host RAM at start-up, which inside a request's swap took seconds for
        FLUX.1's first adapters (bench/results/runs/2026-12-03-lowmem-flux-h200.md). Biases,
        norms and other components (T5) are copied when an adapter first touches them."""
        for key in sorted(self._params.keys() - self._pristine.keys()):
            if self._weight(key).ndim >= 2 and (components is None or key[0] in components):
                self._save_pristine(key, self._weight(key))

    @property
    def pristine_bytes(self) -> int:
        return sum(t.nbytes for t in self._pristine.values())

    @property
    def pristine_layers(self) -> frozenset[LayerKey]:
        """The layers whose pristine copy is saved (every layer a swap has touched, or more)."""
        return frozenset(self._pristine)

    @property
    def float8_layers(self) -> frozenset[LayerKey]:
        """The float8 weights (`--quantize`), which each swap re-quantizes."""
        return frozenset(self._fp8)

    @property
    def layers_without_kernel(self) -> frozenset[LayerKey]:
        """Touched layers the one-pass kernel cannot write (they take the eager path)."""
        return frozenset(key for key, (_, _, kernel_runs) in self._views.items() if not kernel_runs)
