"""The adapters of one served model: where they are, reading them, the cache tiers, and
which ones are kept.

`AdapterStore` is the one object that owns them. It locates an adapter (local folder or
hub), reads and converts it on its own thread pool (off the GPU worker's path), checks it
against the model (`bind_adapter`), and holds it in the tiered cache (`cache.py`) while a
request needs it. The engine is handed what the store acquired and only swaps.

For the benchmark baselines, which load files through diffusers themselves, the store
only locates the files (`reads_adapters=False`).
"""

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import AdapterNotFound, BadRequest
from .bound import BoundAdapter, ModelLayers, bind_adapter
from .cache import AdapterCache, CacheConfig, CacheEntry
from .metadata import refuse_other_base
from .parse import load_adapter
from .source import AdapterLocation, AdapterSources, HubAdapterSource, LocalAdapterSource, check_adapter_id

logger = logging.getLogger(__name__)

# what a request holds from `acquire` until `release`: cache entries (or, for the
# baselines, the adapters' files), each with its blend weight
Acquired = list[tuple[CacheEntry | AdapterLocation, float]]


@dataclass(frozen=True)
class TargetModel:
    """What the store checks adapters against: the served model's name, pipeline class,
    layers and dtype (and the UNet's config: kohya files for SDXL number blocks by it)."""

    name: str
    pipeline_cls: type
    layers: ModelLayers
    dtype: torch.dtype | None  # None: the factors keep the file's dtype
    unet_config: object | None = None


@dataclass(frozen=True)
class StoreLimits:
    max_adapter_bytes: int = 2 * 2**30  # largest adapter file read
    max_rank: int = 1024  # highest LoRA rank accepted
    max_blend: int = 4  # most adapters blended in one request
    prefetch_threads: int = 4  # threads reading adapters ahead of the GPU worker


def make_sources(folder: Path | None, hub: bool = False, hub_cache_dir: Path | None = None,
                 hub_allow=("*",), hub_deny=(), max_bytes: int = 2 * 2**30) -> AdapterSources | None:
    """The adapter folder and/or the hub (None when the server has neither)."""
    local = LocalAdapterSource(folder) if folder else None
    remote = HubAdapterSource(hub_cache_dir, tuple(hub_allow), tuple(hub_deny), max_bytes) if hub else None
    return AdapterSources(local, remote) if local or remote else None


class AdapterStore:
    def __init__(self, source: AdapterSources | None, model: TargetModel, cache: CacheConfig,
                 device: torch.device, limits: StoreLimits = StoreLimits(), reads_adapters: bool = True):
        self.source = source
        self.model = model
        self.limits = limits
        self.reads_adapters = reads_adapters
        self.cache = AdapterCache(cache, device)
        self._files: dict[str, tuple[tuple, AdapterLocation]] = {}  # the baselines' located files, by stamp
        self._pool = ThreadPoolExecutor(limits.prefetch_threads, thread_name_prefix="loraswap-prefetch")

    # ---------------------------------------------------------------- finding
    def locate(self, adapter_id: str) -> AdapterLocation:
        """The adapter's file (404/400 for unknown or bad ids), without reading it."""
        check_adapter_id(adapter_id)
        if self.source is None:
            raise AdapterNotFound(adapter_id, "this server was started without an adapter folder",
                                  "Start it with --adapters DIR")
        return self.source.locate(adapter_id)

    # ---------------------------------------------------------------- holding for a request
    def acquire(self, loras: list[tuple[str, float]]) -> Acquired:
        """The adapters ready to swap in, held until `release`."""
        self._check_blend(loras)
        acquired: Acquired = []
        try:
            for adapter_id, weight in loras:
                held = self.acquire_one(adapter_id) if self.reads_adapters else self._located(adapter_id)
                acquired.append((held, float(weight)))
        except BaseException:
            self.release(acquired)
            raise
        return acquired

    def release(self, acquired: Acquired) -> None:
        for held, _ in acquired:
            if isinstance(held, CacheEntry):
                self.cache.release(held)

    def prefetch(self, loras: list[tuple[str, float]]) -> Future:
        """Start acquiring the adapters now, on the store's threads; the future holds them."""
        if not loras:
            done: Future = Future()
            done.set_result([])
            return done
        return self._pool.submit(self.acquire, loras)

    def acquire_one(self, adapter_id: str) -> CacheEntry:
        """From the cache when the file is unchanged (size, mtime, ctime, inode), else read,
        converted, checked against the model and packed into host RAM (pinned later by the
        cache, off the request's path); then copied to the GPU tier when its budget allows."""
        location = self.locate(adapter_id)
        stamp = _stamp(location)
        entry = self.cache.lookup(adapter_id, stamp)
        if entry is None:
            entry = self.cache.insert(adapter_id, self._read(location), stamp)
        try:
            self.cache.maybe_copy_to_gpu(entry)
        except BaseException:
            self.cache.release(entry)  # (held by the lookup or insert above)
            raise
        return entry

    def _read(self, location: AdapterLocation) -> BoundAdapter:
        return read_adapter(location, self.model, self.limits)

    def _located(self, adapter_id: str) -> AdapterLocation:
        """The file, the same object while it is unchanged (so an unchanged blend is not
        swapped again)."""
        location = self.locate(adapter_id)
        stamp = _stamp(location)
        known = self._files.get(adapter_id)
        if known is None or known[0] != stamp:
            self._files[adapter_id] = known = (stamp, location)
        return known[1]

    def _check_blend(self, loras: list[tuple[str, float]]) -> None:
        if len(loras) > self.limits.max_blend:
            raise BadRequest(f"{len(loras)} adapters requested; at most {self.limits.max_blend} can be blended")
        if len({aid for aid, _ in loras}) != len(loras):
            raise BadRequest("the same adapter is named twice; give it one weight")

    # ---------------------------------------------------------------- admin
    def resolve(self, adapter_id: str) -> BoundAdapter:
        """The adapter checked against this model (host tier), e.g. for inspection."""
        entry = self.acquire_one(adapter_id)
        self.cache.release(entry)
        return entry.host

    def keep(self, adapter_id: str) -> BoundAdapter:
        """Read the adapter into the cache now and never evict it until `evict`."""
        entry = self.acquire_one(adapter_id)
        self.cache.keep(adapter_id)
        self.cache.release(entry)
        return entry.host

    def evict(self, adapter_id: str) -> None:
        """Stop keeping the adapter and drop it from every tier (it is read again when next used)."""
        check_adapter_id(adapter_id)
        if self.cache.get(adapter_id) is None:
            self.locate(adapter_id)  # an id neither cached nor on disk: 404
        self.cache.evict(adapter_id)

    def rows(self, applied_ids=(), cached_only: bool = False) -> list[dict]:
        """Every adapter in a cache tier (hub adapters too) and, unless `cached_only`, in the
        folder: its id, tier, whether it is kept and applied, and once read its base model,
        rank, size and kinds (`lora`, `loha`, `lokr`, `full`, `+dora`, `bias`)."""
        applied = {aid for aid, _ in applied_ids}
        listed = set(self.source.list_ids()) if self.source is not None and not cached_only else set()
        return [self._row(adapter_id, applied) for adapter_id in sorted(listed | set(self.cache.ids()))]

    def _row(self, adapter_id: str, applied: set[str]) -> dict:
        entry = self.cache.get(adapter_id)
        row = {"id": adapter_id, "cached": entry.tier.value if entry else "disk",
               "kept": bool(entry and entry.kept), "applied": adapter_id in applied}
        if entry is not None:
            bound = entry.host
            row.update(base_model=bound.base_models[0] if bound.base_models else self.model.name,
                       rank=bound.rank, bytes=bound.nbytes, layers=len(bound.layers), kinds=bound.kinds())
        return row


    def close(self) -> None:
        """Stop the store's reading threads and the cache's pinner (the server's shutdown)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()


def read_adapter(location: AdapterLocation, model: TargetModel, limits: StoreLimits = StoreLimits()) -> BoundAdapter:
    """The adapter at `location` read, converted, checked against `model` (its declared base
    model too) and bound to its layers: what the store caches, and what the benchmarks use."""
    parsed = load_adapter(location, model.pipeline_cls, model.layers.component_modules, limits.max_adapter_bytes,
                          model.unet_config)
    refuse_other_base(location.adapter_id, parsed.base_models, [model.name])
    return bind_adapter(parsed, model.layers, limits.max_rank, model.dtype)


def _stamp(location: AdapterLocation) -> tuple:
    """What tells a changed file (or pair of expert files) from the one cached."""
    stamp = ()
    for path in (location.weights, location.second_expert):
        if path is not None:
            stat = path.stat()
            # ctime and inode too: a copy that keeps the mtime (cp -p, rsync -t, tar) is still a new file
            stamp += (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
    return stamp
