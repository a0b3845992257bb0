"""The two ways of serving a LoRA that loraswap is measured against, as swappers.

- load-and-fuse (`--swap-mode load-and-fuse`): what the Hugging Face Inference API image
  does per request. Unfuse and unload the previous adapter, `load_lora_weights` and
  `fuse_lora` the new one, on an eager model; no cache: the file is read every time.
- hotswap (`--swap-mode hotswap`): diffusers + PEFT hotswap. Before compiling,
  `enable_lora_hotswap(target_rank)` and a first adapter (here: zeros on every layer an
  adapter may target, so the base model is served too); each request then loads its
  adapter into that slot with `hotswap=True`, and the compiled model never recompiles.
  One adapter at a time, weight 1, denoiser layers only, ranks up to the target rank:
  diffusers fails on the others after the denoiser was already swapped, so they are
  refused from the file's header first.

Both implement the swapper interface (`fused.Swapper`) as `fused.FusedSwapper` does, so
the engine never branches on which one it drives. They lease the adapters' files
(`AdapterLocation`, from `LocatedFiles`, beside the adapter store), not parsed adapters:
diffusers reads the files itself.
"""

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from diffusers import DiffusionPipeline
from safetensors import safe_open

from loraswap.adapters.files.facts import FileFacts
from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.lease import Lease
from loraswap.adapters.parse.changes import split_key
from loraswap.adapters.random import make_random_adapter
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.store import AdapterStore
from loraswap.errors import AdapterIncompatible, BadRequest
from loraswap.models import denoiser_name
from loraswap.tracing import RequestContext

HOTSWAP_SLOT = "hotswap"  # the one adapter name every hotswap loads into


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class LocatedFiles:
    """The baselines' adapters: their files, found through the store's sources and limits but
    never read or cached (diffusers reads them itself), leased as the store leases adapters.
    A file is the same object while it is unchanged on disk, so an unchanged blend is not
    swapped again."""

    def __init__(self, store: AdapterStore):
        self.store = store
        self.files: FileFacts[AdapterLocation] = FileFacts()  # adapter id -> its file, while unchanged
        # locating a hub adapter downloads it: off the caller's thread, as the store reads
        self._pool = ThreadPoolExecutor(store.limits.prefetch_threads, thread_name_prefix="loraswap-locate")

    def lease(self, refs: list[AdapterRef], located: Mapping[str, AdapterLocation] | None = None) -> Future:
        # (on the pool in the request's context: its log lines)
        return self._pool.submit(RequestContext.capture().run, self.lease_now, refs, located)

    def lease_now(self, refs: list[AdapterRef], located: Mapping[str, AdapterLocation] | None = None) -> Lease:
        """`located`: the files already found for them, by id (routing's), not located again."""
        self.store.check_blend(refs)
        located = located or {}
        return Lease([(self._located(ref, located.get(ref.adapter_id)), float(ref.scale)) for ref in refs])

    def _located(self, ref: AdapterRef, location: AdapterLocation | None) -> AdapterLocation:
        adapter_id = ref.adapter_id
        location, stamp = self.store.stamped(ref, location)
        known = self.files.get(adapter_id, stamp)
        if known is None:
            for path in (location.weights, location.second_expert):  # its header bounded before anyone parses it
                if path is not None:
                    open_checked(path, adapter_id, self.store.limits.max_adapter_bytes).close()
            self.files.put(adapter_id, stamp, location)
            known = location
        return known


class LoadAndFuseSwapper:
    compiles = False  # PEFT replaces modules at each load: a compiled model would recompile

    def __init__(self, pipeline: DiffusionPipeline):
        self.pipeline = pipeline
        self._loaded = False

    @classmethod
    def for_engine(cls, pipeline: DiffusionPipeline, layers, config) -> "LoadAndFuseSwapper":
        return cls(pipeline)

    def lender(self, store: AdapterStore) -> LocatedFiles:
        """diffusers reads the file itself, every time: the adapters' files are leased, not read."""
        return LocatedFiles(store)

    def check(self, adapters: Sequence[tuple[AdapterLocation, float]]) -> None:
        """diffusers' own checks (what the Hugging Face image does), and a refusal of the
        kinds diffusers would drop or fail on (`refuse_kinds_diffusers_drops`)."""
        for location, _ in adapters:
            refuse_kinds_diffusers_drops(location, self.pipeline)

    def prepare_to_compile(self) -> None:
        """Nothing: this baseline runs eager."""

    def warm_up(self) -> bool:
        """Nothing to warm: diffusers' own ops."""
        return False

    def apply(self, adapters: Sequence[tuple[AdapterLocation, float]]) -> float:
        """Unload the previous adapters, then load and fuse these; seconds taken."""
        start = time.perf_counter()
        pipeline = self.pipeline
        self._unload()
        names = [f"lora{i}" for i in range(len(adapters))]
        try:
            for name, (location, _) in zip(names, adapters):
                self._loaded = True
                pipeline.load_lora_weights(str(location.weights), adapter_name=name)
                self._load_second_expert(location, name)
            if names:
                pipeline.set_adapters(names, [weight for _, weight in adapters])
                pipeline.fuse_lora(adapter_names=names)
        except BaseException:
            self._unload()  # back to the base model, as the engine then records
            raise
        _synchronize()
        return time.perf_counter() - start

    def restore_base(self) -> None:
        """Back to the base model: the adapters unfused and unloaded."""
        self.apply([])

    def _load_second_expert(self, location: AdapterLocation, name: str) -> None:
        """Wan 2.2's second expert, the way diffusers offers (`load_into_transformer_2`): the
        low-noise file of a pair, or a file's `transformer_2.` keys, which `load_lora_weights`
        otherwise skips without an error (loaded as `transformer.` keys, with their scales)."""
        pipeline = self.pipeline
        if getattr(pipeline, "transformer_2", None) is None:  # Wan 2.1 (and a bench's bare denoiser)
            return
        if location.second_expert is not None:
            pipeline.load_lora_weights(str(location.second_expert), adapter_name=name, load_into_transformer_2=True)
            return
        state_dict, metadata = pipeline.lora_state_dict(str(location.weights), return_lora_metadata=True)
        second = {key.replace("transformer_2.", "transformer.", 1): value for key, value in state_dict.items()
                  if key.startswith("transformer_2.")}
        if second:
            scales = {key.replace("transformer_2.", "transformer.", 1): value for key, value in (metadata or {}).items()
                      if key.startswith("transformer_2.")}
            pipeline.load_lora_into_transformer(second, transformer=pipeline.transformer_2, adapter_name=name,
                                                metadata=scales or None, _pipeline=pipeline)

    def _unload(self) -> None:
        if self._loaded:
            self.pipeline.unfuse_lora()
            self.pipeline.unload_lora_weights()
            self._loaded = False


class HotswapSwapper:
    compiles = True

    def __init__(self, pipeline: DiffusionPipeline, target_rank: int):
        self.pipeline = pipeline
        self.target_rank = target_rank
        self._denoiser = denoiser_name(pipeline)
        self._placeholder: dict[str, torch.Tensor] | None = None

    @classmethod
    def for_engine(cls, pipeline: DiffusionPipeline, layers, config) -> "HotswapSwapper":
        return cls(pipeline, config.swap.hotswap_rank)

    def lender(self, store: AdapterStore) -> LocatedFiles:
        return LocatedFiles(store)

    def prepare_to_compile(self) -> None:
        """Hotswap enabled and the placeholder loaded: what the compiled graphs will see."""
        denoiser = getattr(self.pipeline, self._denoiser)
        state_dict, _ = make_random_adapter({self._denoiser: denoiser}, self.target_rank, "all",
                                            dtype=denoiser.dtype)
        self._placeholder = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in state_dict.items()}
        self.pipeline.enable_lora_hotswap(target_rank=self.target_rank)
        self.pipeline.load_lora_weights(self._fresh_placeholder(), adapter_name=HOTSWAP_SLOT)

    def _fresh_placeholder(self) -> dict[str, torch.Tensor]:
        """A copy of the placeholder's tensors: PEFT may keep the loaded tensors as the slot's
        parameters, which each hotswap then overwrites in place."""
        return {key: tensor.clone() for key, tensor in self._placeholder.items()}

    def warm_up(self) -> bool:
        """Nothing to warm beyond the compiled model."""
        return False

    def apply(self, adapters: Sequence[tuple[AdapterLocation, float]]) -> float:
        """Hotswap the adapter (or the zeros of the base model) into the slot; seconds taken."""
        if self._placeholder is None:
            self.prepare_to_compile()
        start = time.perf_counter()
        source = str(adapters[0][0].weights) if adapters else self._fresh_placeholder()
        try:
            self.pipeline.load_lora_weights(source, adapter_name=HOTSWAP_SLOT, hotswap=True)
        except BaseException:  # back to the base model, as the engine then records
            self.pipeline.load_lora_weights(self._fresh_placeholder(), adapter_name=HOTSWAP_SLOT, hotswap=True)
            raise
        _synchronize()
        return time.perf_counter() - start

    def restore_base(self) -> None:
        """Back to the base model: zeros in the slot."""
        self.apply([])

    def check(self, adapters: Sequence[tuple[AdapterLocation, float]]) -> None:
        """Refuse, from the headers alone and before anything changes, what diffusers'
        hotswap would fail on halfway."""
        if len(adapters) > 1:
            raise BadRequest("the hotswap baseline serves one adapter at a time; name one adapter")
        if adapters and adapters[0][0].second_expert is not None:
            raise AdapterIncompatible(adapters[0][0].adapter_id, "it is a pair of expert files, which the hotswap "
                                      "baseline does not load", "Use --swap-mode fused")
        if adapters:
            self._check_one(*adapters[0])

    def _check_one(self, location: AdapterLocation, weight: float) -> None:
        aid = location.adapter_id
        if weight != 1.0:
            raise BadRequest(f"adapter '{aid}': the hotswap baseline applies adapters at weight 1 only "
                             "(a weight goes through set_adapters, which recompiles)")
        refuse_kinds_diffusers_drops(location, self.pipeline)
        with safe_open(str(location.weights), "pt") as f:
            for key in f.keys():
                if key.startswith(("text_encoder", "lora_te", "transformer_2.")):
                    raise AdapterIncompatible(aid, f"key '{key}' targets a text encoder or a second expert, which "
                                              "hotswap cannot swap", "Use --swap-mode fused for these adapters")
                is_down = ".lora_A." in key or ".lora_down." in key
                if is_down and f.get_slice(key).get_shape()[0] > self.target_rank:
                    raise AdapterIncompatible(aid, f"key '{key}' has a rank over the hotswap target rank "
                                              f"{self.target_rank}", "Raise --hotswap-rank")


def refuse_kinds_diffusers_drops(location: AdapterLocation, pipeline: DiffusionPipeline) -> None:
    """The baselines load through diffusers, which reads plain LoRA pairs only: it drops
    DoRA scales, `.diff`, `.diff_b`, norm and T5 keys (with an info log) and fails on LoHa and
    LoKr. Refused here, from the header, rather than served as a different adapter."""
    second_text_encoder = "text_encoder_2" in pipeline._lora_loadable_modules
    with safe_open(str(location.weights), "pt") as f:
        for key in f.keys():
            kind, factor = (split_key(key) or ("", "unknown", ""))[1:]
            plain = kind == "alpha" or (kind == "lora" and factor in ("down", "up"))
            dropped = key.startswith("text_encoders.t5xxl") or key.startswith("lora_te2_") and not second_text_encoder
            if not plain or dropped:
                raise AdapterIncompatible(location.adapter_id, f"key '{key}' is not a plain LoRA weight, which the "
                                          "load-and-fuse and hotswap baselines (diffusers' loader) cannot apply",
                                          "Use --swap-mode fused, which applies every adapter kind")

