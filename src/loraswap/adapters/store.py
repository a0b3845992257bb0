"""The adapters of one served model: where they are, reading them, the cache tiers, and
which ones are kept.

`AdapterStore` is the one object that owns them. It locates an adapter (local folder or
hub), reads and converts it on its own thread pool (off the GPU worker's path), hashes its
file meanwhile for the images' records (`file_hashes.py`), checks it against the model
(`bind_adapter`), and holds it in the tiered cache (`cache.py`) while a
request needs it: the store hands out a `Lease` (`lease.py`), and whoever takes a lease
gives it back (the server's GPU worker, for every request). The engine swaps what a lease
holds and never holds adapters itself.
"""

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from loraswap.adapters.bound import BoundAdapter, ModelLayers, bind_adapter, fitted_layers
from loraswap.adapters.cache import AdapterCache, CacheConfig, CacheEntry
from loraswap.adapters.files.data import NotInFile
from loraswap.adapters.files.device_read import DeviceReadFailed, staging_buffers, with_index
from loraswap.adapters.files.facts import FileFacts
from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.hashes import hash_version
from loraswap.adapters.files.metadata import refuse_other_base
from loraswap.adapters.lease import Lease
from loraswap.adapters.naming.references import check_id
from loraswap.adapters.parse.changes import ParsedAdapter, check_key_kinds, load_adapter
from loraswap.adapters.sources.download_locks import holding_downloads
from loraswap.adapters.sources.local import (
    AdapterLocation,
    AdapterSources,
    HubAdapterSource,
    LocalAdapterSource,
    file_stamp,
    stamp_bytes,
)
from loraswap.adapters.sources.remote import RemoteSettings, RemoteSources
from loraswap.errors import AdapterError, AdapterIncompatible, AdapterInvalid, AdapterNotFound, BadRequest
from loraswap.tracing import RequestContext, adapter_attributes, traced

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
                 hub_allow=("*",), hub_deny=(), max_bytes: int = 2 * 2**30,
                 remote: RemoteSources | None = None) -> AdapterSources | None:
    """The adapter folder, the hub, and files elsewhere (None when the server has none of them)."""
    local = LocalAdapterSource(folder) if folder else None
    hub_source = HubAdapterSource(hub_cache_dir, tuple(hub_allow), tuple(hub_deny), max_bytes) if hub else None
    return AdapterSources(local, hub_source, remote) if local or hub_source or remote else None


def make_remote(settings: RemoteSettings, download_dir: Path, download_bytes: int) -> RemoteSources:
    """Files named by URL, Civitai or bucket, each source refused until its setting turns it on."""
    return RemoteSources(settings, download_dir, download_bytes)


class AdapterStore:
    def __init__(self, source: AdapterSources | None, model: TargetModel, cache: CacheConfig,
                 device: torch.device, limits: StoreLimits = StoreLimits()):
        self.source = source
        self.model = model
        self.limits = limits
        device = with_index(device)  # the store's threads do not share the caller's current GPU
        self.cache = AdapterCache(cache, device)
        self._fits: FileFacts[bool] = FileFacts()  # adapter id -> whether its file (as stamped) fits this model
        # the SHA-256 of each file read, for the images' records: hashed alongside the read, not after it
        self._hashing = ThreadPoolExecutor(limits.prefetch_threads, thread_name_prefix="loraswap-hash")
        # no other model of this server reads its downloads: a file this model refuses, none here
        # takes (a deployment of several models says otherwise: `routing.Deployment`)
        self.sole_model = True
        self._pool = ThreadPoolExecutor(limits.prefetch_threads, thread_name_prefix="loraswap-prefetch")
        if device.type == "cuda" and cache.gpu_bytes:  # (with no GPU tier nothing is read to the GPU)
            staging_buffers(device).warm()  # pinned now, not in the first cold request

    # ---------------------------------------------------------------- finding
    def locate(self, adapter_id: str) -> AdapterLocation:
        """The adapter's file (404/400 for unknown or bad ids), without reading it; a file
        elsewhere is fetched into the download cache first."""
        check_id(adapter_id)
        if self.source is None:
            raise AdapterNotFound(adapter_id, "this server was started without an adapter folder",
                                  "Start it with --adapters DIR")
        return self.source.locate(adapter_id)

    # ---------------------------------------------------------------- leases
    def lease(self, loras: list[tuple[str, float]]) -> Future:
        """Start reading the adapters now, on the store's threads; the future holds their `Lease`."""
        if not loras:
            done: Future = Future()
            done.set_result(Lease([]))
            return done
        # in the request's context: the reading thread's log lines and spans are the request's
        return self._pool.submit(RequestContext.capture().run, self.lease_now, loras)

    @traced("read", lambda store, loras: adapter_attributes(loras))
    def lease_now(self, loras: list[tuple[str, float]]) -> Lease:
        """The adapters (id, weight) ready to swap in, read on this thread and held until the
        lease is given back."""
        self.check_blend(loras)
        held: list[tuple[CacheEntry, float]] = []
        try:
            for adapter_id, weight in loras:
                held.append((self._hold(adapter_id), float(weight)))
        except BaseException:
            for entry, _ in held:
                self.cache.release(entry)
            raise
        return Lease(held, self.cache.release)

    def read_ahead(self, loras: list[tuple[str, float]]) -> Future:
        """Read the adapters into the cache on the store's threads, holding none of them."""
        return self._pool.submit(lambda: self.lease_now(loras).release())

    def keep_ahead(self, adapter_id: str) -> Future:
        """`keep` on the store's threads."""
        return self._pool.submit(self.keep, adapter_id)

    def check_blend(self, loras: list[tuple[str, float]]) -> None:
        """Refuse a blend of more adapters than the limit, or one naming an adapter twice."""
        if len(loras) > self.limits.max_blend:
            raise BadRequest(f"{len(loras)} adapters requested; at most {self.limits.max_blend} can be blended")
        if len({aid for aid, _ in loras}) != len(loras):
            raise BadRequest("the same adapter is named twice; give it one weight")

    def _hold(self, adapter_id: str) -> CacheEntry:
        """From the cache when the file is unchanged (size, mtime, ctime, inode), else read,
        converted, checked against the model and packed into host RAM (pinned later by the
        cache, off the request's path); then copied to the GPU tier when its budget allows.
        Held in the cache until released."""
        with holding_downloads():  # a downloaded file stays while it is looked at and read
            location = self.locate(adapter_id)
            stamp = file_stamp(location)
            entry = self.cache.lookup(adapter_id, stamp)
            if entry is None:
                entry = self._read_and_hash(location, stamp)
        try:
            self.cache.maybe_copy_to_gpu(entry)
        except BaseException:
            self.cache.release(entry)  # (held by the lookup or insert above)
            raise
        return entry

    def _read_and_hash(self, location: AdapterLocation, stamp: tuple) -> CacheEntry:
        """The adapter read into the cache, its file hashed on another thread meanwhile (the
        digest kept with the entry: `CacheEntry.digest`)."""
        hashing = self._hashing.submit(hash_version, location, stamp)
        try:
            bound = self._read_or_drop(location, stamp_bytes(stamp))
        except BaseException:
            hashing.cancel()
            raise
        entry = self.cache.insert(location.adapter_id, bound, stamp)
        if entry.digest is None:  # (one read twice at once keeps the first entry, and its digest)
            entry.digest = hashing.result()
        return entry

    def _read_or_drop(self, location: AdapterLocation, nbytes: int) -> BoundAdapter:
        """`_read`; a downloaded file that no model here can take is dropped from the download
        folder (neither listed nor taking room, and fetched again if named again): one with a
        defect of its own (`has_own_defect`), or one this model refuses when it is the only
        model (`sole_model`). A file made for another model of this server stays for that model."""
        try:
            return self._read(location, nbytes)
        except (AdapterInvalid, AdapterIncompatible):
            if self.sole_model or has_own_defect(location, self.limits.max_adapter_bytes):
                self.forget_file(location.adapter_id)
            raise

    def forget_file(self, adapter_id: str) -> None:
        """Drop the adapter's download, if it has one, and what was found out about its file."""
        self._fits.drop(adapter_id)
        if self.source is not None:
            self.source.forget(adapter_id)

    def _read(self, location: AdapterLocation, nbytes: int) -> BoundAdapter:
        """The adapter's `nbytes` of files read: on CUDA straight to the GPU when the cache
        gives it a turn (`start_gpu_read`; the cache copies it down to host RAM later), else
        on the host."""
        if not self.cache.start_gpu_read(nbytes):
            return read_adapter(location, self.model, self.limits)
        try:
            bound = read_adapter(location, self.model, self.limits, self.cache.device)
        except DeviceReadFailed as e:
            self.cache.end_gpu_read()
            logger.warning("adapter %s could not be read to the GPU (%s); read on the host", location.adapter_id, e)
            return read_adapter(location, self.model, self.limits)
        except BaseException:
            self.cache.end_gpu_read()
            raise
        if bound.packed is not None and bound.packed.is_cuda:  # its turn ends when this GPU copy is dropped
            weakref.finalize(bound, self.cache.end_gpu_read)
        else:  # read whole: packed on the host
            self.cache.end_gpu_read()
        return bound

    def fits(self, location: AdapterLocation) -> bool:
        """Whether the adapter's keys and shapes fit this model's layers: read once per file
        (size, mtime, ctime, inode), as routing asks on every request naming it. A defect of
        the file itself (not safetensors, truncated, a header over its bounds) is no "does not
        fit": it is raised as it is, whatever the model."""
        stamp = file_stamp(location)
        known = self._fits.get(location.adapter_id, stamp)
        if known is not None:
            return known
        for path in (location.weights, location.second_expert):
            if path is not None:
                open_checked(path, location.adapter_id, self.limits.max_adapter_bytes).close()
        try:
            check_fit(location, self.model, self.limits)
            fits = True
        except AdapterError:
            fits = False
        self._fits.put(location.adapter_id, stamp, fits)
        return fits

    # ---------------------------------------------------------------- admin
    def resolve(self, adapter_id: str) -> BoundAdapter:
        """The adapter checked against this model (host tier), e.g. for inspection."""
        entry = self._hold(adapter_id)
        self.cache.release(entry)
        return entry.host

    def keep(self, adapter_id: str) -> BoundAdapter:
        """Read the adapter into the cache now and never evict it until `evict`."""
        entry = self._hold(adapter_id)
        self.cache.keep(adapter_id)
        self.cache.release(entry)
        return entry.host

    def evict(self, adapter_id: str) -> None:
        """Stop keeping the adapter and drop it from every tier, a download's file included (it
        is read, or fetched, again when next used)."""
        check_id(adapter_id)
        if self.cache.get(adapter_id) is None and adapter_id not in self._downloaded():
            self.locate(adapter_id)  # an id neither cached nor on disk: 404
        self.cache.evict(adapter_id)
        self.forget_file(adapter_id)

    def _downloaded(self) -> set[str]:
        remote = self.source.remote if self.source is not None else None
        return set(remote.list_ids()) if remote is not None else set()

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
               "kept": bool(entry and entry.kept), "applied": adapter_id in applied,
               "source": self.source.source_name(adapter_id) if self.source is not None else "folder"}
        if entry is not None:
            bound = entry.host
            row.update(base_model=bound.base_models[0] if bound.base_models else self.model.name,
                       rank=bound.rank, bytes=bound.nbytes, layers=len(bound.layers), kinds=bound.kinds())
        return row

    def close(self) -> None:
        """Stop the store's reading threads and the cache's pinner (the server's shutdown)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hashing.shutdown(wait=False, cancel_futures=True)
        self.cache.close()


def read_adapter(location: AdapterLocation, model: TargetModel, limits: StoreLimits = StoreLimits(),
                 device: str | torch.device = "cpu") -> BoundAdapter:
    """The adapter at `location` read, converted, checked against `model` (its declared base
    model too) and bound to its layers, packed on `device` where it was read in place: what
    the store caches, and what the benchmarks use."""
    return _parse_and(location, model, limits, lambda parsed: bind_adapter(parsed, model.layers, limits.max_rank,
                                                                           model.dtype, device))


def has_own_defect(location: AdapterLocation, max_bytes: int) -> bool:
    """Whether the adapter's files are refused whatever model reads them: a header the checks
    refuse (not safetensors, truncated, over its bounds) or keys of no adapter kind. When not,
    a refusal is one model's (its layers, shapes or base model), and another may take it."""
    try:
        for path in (location.weights, location.second_expert):
            if path is not None:
                file = open_checked(path, location.adapter_id, max_bytes)
                file.close()
                check_key_kinds(location.adapter_id, file.header)
    except AdapterInvalid:
        return True
    return False


def check_fit(location: AdapterLocation, model: TargetModel, limits: StoreLimits = StoreLimits()) -> None:
    """Raise what reading the adapter for `model` would raise for its keys, base model and
    shapes, having read only its header and small tensors (its values are not checked)."""
    _parse_and(location, model, limits, lambda parsed: fitted_layers(parsed, model.layers, limits.max_rank))


def _parse_and(location: AdapterLocation, model: TargetModel, limits: StoreLimits,
               use: Callable[[ParsedAdapter], T]) -> T:
    """`use` the adapter parsed for `model`. Read in place (the large factors read from the
    file only when packed, straight into their place: one copy), unless the parse or `use`
    needs the values of a factor standing in (one the parse computes): then read whole."""
    try:
        return _parsed_use(location, model, limits, use, in_place=True)
    except (NotInFile, RuntimeError, NotImplementedError) as e:  # RuntimeError: a value asked of a stand-in
        logger.debug("adapter %s read whole (%s)", location.adapter_id, e)
        return _parsed_use(location, model, limits, use, in_place=False)


def _parsed_use(location: AdapterLocation, model: TargetModel, limits: StoreLimits, use: Callable[[ParsedAdapter], T],
                in_place: bool) -> T:
    parsed = load_adapter(location, model.pipeline_cls, model.layers.component_modules, limits.max_adapter_bytes,
                          model.unet_config, in_place)
    try:
        refuse_other_base(location.adapter_id, parsed.base_models, [model.name])
        return use(parsed)
    finally:
        for file in parsed.files:
            file.close()
