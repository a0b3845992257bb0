"""The adapters of one served model: where they are, reading them, the cache tiers, and
which ones are kept.

`AdapterStore` is the one object that owns them, and its verbs are an adapter's life:
- **locate** a ref (`adapters/reference.py`): where its file is (`sources/`), fetched first
  when it comes from elsewhere;
- **read** it: the file parsed and converted (`parse/`), checked against the model and
  bound to its layers (`bound.bind_adapter`), on the store's own threads (off the GPU
  worker's path), its file hashed for the images' records (`files/hashes.py`);
- **lease** it to a request, held in the tiered cache (`cache.py`) until the lease is
  **released** (`lease.py`): whoever takes a lease gives it back (the server's GPU worker,
  for every request); the engine swaps what a lease holds and never holds adapters itself;
- **keep** it cached until an admin **evicts** it (a download's file too).
"""

import logging
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from loraswap.adapters.bound import BoundAdapter, ModelLayers, bind_adapter, fitted_layers
from loraswap.adapters.cache import AdapterCache, CacheConfig, CacheEntry
from loraswap.adapters.files.data import NotInFile
from loraswap.adapters.files.device_read import DeviceReadFailed, staging_buffers, with_index
from loraswap.adapters.files.facts import FileFacts
from loraswap.adapters.files.formats import open_checked
from loraswap.adapters.files.hashes import ReadDigest
from loraswap.adapters.files.location import AdapterLocation, file_stamp, stamp_bytes
from loraswap.adapters.files.metadata import refuse_other_base
from loraswap.adapters.lease import Lease
from loraswap.adapters.parse.changes import ParsedAdapter, check_key_kinds, parse_adapter_file
from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.choose import AdapterSources
from loraswap.adapters.sources.download_locks import holding_downloads
from loraswap.errors import (
    AdapterChanged,
    AdapterError,
    AdapterIncompatible,
    AdapterInvalid,
    AdapterNotFound,
    BadRequest,
)
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


class AdapterStore:
    def __init__(self, source: AdapterSources | None, model: TargetModel, cache: CacheConfig,
                 device: torch.device, limits: StoreLimits = StoreLimits()):
        self.source = source
        self.model = model
        self.limits = limits
        device = with_index(device)  # the store's threads do not share the caller's current GPU
        self.cache = AdapterCache(cache, device)
        self.fit_answers: FileFacts[bool] = FileFacts()  # adapter id -> whether its file (as stamped) fits this model
        # no other model of this server reads its downloads: a file this model refuses, none here
        # takes (a deployment of several models says otherwise: `routing.Deployment`)
        self.sole_model = True
        self._pool = ThreadPoolExecutor(limits.prefetch_threads, thread_name_prefix="loraswap-prefetch")
        if device.type == "cuda" and cache.gpu_bytes:  # (with no GPU tier nothing is read to the GPU)
            staging_buffers(device).warm()  # pinned now, not in the first cold request

    # ---------------------------------------------------------------- locate
    def locate(self, ref: AdapterRef) -> AdapterLocation:
        """The adapter's file (404 for an unknown one), without reading it; a file elsewhere is
        fetched into the download cache first. The ref was checked where it was made."""
        if self.source is None:
            raise AdapterNotFound(ref.adapter_id, "this server was started without an adapter folder",
                                  "Start it with --adapters DIR")
        return self.source.locate(ref)

    # ---------------------------------------------------------------- lease, release
    def lease(self, refs: list[AdapterRef], located: Mapping[str, AdapterLocation] | None = None) -> Future:
        """Start reading the adapters now, on the store's threads; the future holds their `Lease`.
        `located`: the files already found for them, by id (routing's), not located again."""
        if not refs:
            done: Future = Future()
            done.set_result(Lease([]))
            return done
        # in the request's context: the reading thread's log lines and spans are the request's
        return self._pool.submit(RequestContext.capture().run, self.lease_now, refs, located)

    @traced("read", lambda store, refs, located=None: adapter_attributes((r.adapter_id, r.scale) for r in refs))
    def lease_now(self, refs: list[AdapterRef], located: Mapping[str, AdapterLocation] | None = None) -> Lease:
        """The adapters ready to swap in, read on this thread and held until the lease is
        released (given back); `located` as `lease` takes it."""
        self.check_blend(refs)
        located = located or {}
        held: list[tuple[CacheEntry, float]] = []
        try:
            for ref in refs:
                held.append((self._lease_one(ref, located.get(ref.adapter_id)), float(ref.scale)))
        except BaseException:
            for entry, _ in held:
                self.cache.release(entry)
            raise
        return Lease(held, self.cache.release)

    def read_ahead(self, refs: list[AdapterRef]) -> Future:
        """Read the adapters into the cache on the store's threads, holding none of them."""
        return self._pool.submit(lambda: self.lease_now(refs).release())

    def keep_ahead(self, ref: AdapterRef) -> Future:
        """`keep` on the store's threads."""
        return self._pool.submit(self.keep, ref)

    def check_blend(self, refs: list[AdapterRef]) -> None:
        """Refuse a blend of more adapters than the limit, or one naming an adapter twice."""
        if len(refs) > self.limits.max_blend:
            raise BadRequest(f"{len(refs)} adapters requested; at most {self.limits.max_blend} can be blended")
        if len({ref.adapter_id for ref in refs}) != len(refs):
            raise BadRequest("the same adapter is named twice; give it one weight")

    def _lease_one(self, ref: AdapterRef, location: AdapterLocation | None = None) -> CacheEntry:
        """From the cache when the file is unchanged (size, mtime, ctime, inode), else read,
        converted, checked against the model and packed into host RAM (pinned later by the
        cache, off the request's path); then copied to the GPU tier when its budget allows.
        Held in the cache until released. `location`: its file, when already found."""
        with holding_downloads():  # a downloaded file stays while it is looked at and read
            location, stamp = self.stamped(ref, location)
            entry = self.cache.lookup(ref.adapter_id, stamp)
            if entry is None:
                entry = self._read_and_hash(location, stamp)
        try:
            self.cache.maybe_copy_to_gpu(entry)
        except BaseException:
            self.cache.release(entry)  # (held by the lookup or insert above)
            raise
        return entry

    def stamped(self, ref: AdapterRef, location: AdapterLocation | None = None) -> tuple[AdapterLocation, tuple]:
        """The adapter's file and its `file_stamp`: the file already found while it is still there,
        else located now, so that one removed since it was found (the request queued meanwhile) is
        unknown (404) as if never found, not "removed while it was being read"."""
        if location is not None:
            try:
                return location, file_stamp(location)
            except AdapterChanged:
                pass
        location = self.locate(ref)
        return location, file_stamp(location)

    def _read_and_hash(self, location: AdapterLocation, stamp: tuple) -> CacheEntry:
        """The adapter read into the cache, its file hashed from the bytes the read brings in
        (`files.hashes.ReadDigest`), the digest kept with the entry (`CacheEntry.digest`)."""
        digest = ReadDigest()
        bound = self._read_or_drop(location, stamp_bytes(stamp), digest)
        entry = self.cache.insert(location.adapter_id, bound, stamp)
        if entry.digest is None:  # (one read twice at once keeps the first entry, and its digest)
            entry.digest = digest.result if _unchanged(location, stamp) else None
        return entry

    def _read_or_drop(self, location: AdapterLocation, nbytes: int, digest: ReadDigest) -> BoundAdapter:
        """`_read`; a downloaded file that no model here can take is dropped from the download
        folder (neither listed nor taking room, and fetched again if named again): one with a
        defect of its own (`has_own_defect`), or one this model refuses when it is the only
        model (`sole_model`). A file made for another model of this server stays for that model."""
        try:
            return self._read(location, nbytes, digest)
        except (AdapterInvalid, AdapterIncompatible):
            if self.sole_model or has_own_defect(location, self.limits.max_adapter_bytes):
                self.evict_download(location.adapter_id)
            raise

    def evict_download(self, adapter_id: str) -> None:
        """Drop the adapter's download, if it has one, and what was found out about its file."""
        self.fit_answers.drop(adapter_id)
        if self.source is not None:
            self.source.evict(adapter_id)

    def _read(self, location: AdapterLocation, nbytes: int, digest: ReadDigest | None = None) -> BoundAdapter:
        """The adapter's `nbytes` of files read: on CUDA straight to the GPU when the cache
        gives it a turn (`start_gpu_read`; the cache copies it down to host RAM later), else
        on the host; its weights file hashed by `digest` as it is read."""
        if not self.cache.start_gpu_read(nbytes):
            return read_adapter(location, self.model, self.limits, digest=digest)
        try:
            bound = read_adapter(location, self.model, self.limits, self.cache.device, digest=digest)
        except DeviceReadFailed as e:
            self.cache.end_gpu_read()
            logger.warning("adapter %s could not be read to the GPU (%s); read on the host", location.adapter_id, e)
            return read_adapter(location, self.model, self.limits, digest=digest)
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
        known = self.fit_answers.get(location.adapter_id, stamp)
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
        self.fit_answers.put(location.adapter_id, stamp, fits)
        return fits

    # ---------------------------------------------------------------- read, keep, evict
    def read(self, ref: AdapterRef) -> BoundAdapter:
        """The adapter read and bound to this model (host tier; from the cache when there), e.g.
        for inspection."""
        entry = self._lease_one(ref)
        self.cache.release(entry)
        return entry.host

    def keep(self, ref: AdapterRef, location: AdapterLocation | None = None) -> BoundAdapter:
        """Read the adapter into the cache now and never evict it until `evict`. `location`: its
        file, already found (routing's, as a lease takes it), not located again."""
        entry = self._lease_one(ref, location)
        self.cache.keep(ref.adapter_id)
        self.cache.release(entry)
        return entry.host

    def evict(self, ref: AdapterRef, location: AdapterLocation | None = None) -> None:
        """Stop keeping the adapter and drop it from every tier, a download's file included (it
        is read, or fetched, again when next used). `location`: its file, already found
        (routing's), so the id is known here and not located again."""
        adapter_id = ref.adapter_id
        if location is None and self.cache.get(adapter_id) is None and adapter_id not in self._downloaded():
            self.locate(ref)  # an id neither cached nor on disk: 404
        self.cache.evict(adapter_id)
        self.evict_download(adapter_id)

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
        self.cache.close()


def read_adapter(location: AdapterLocation, model: TargetModel, limits: StoreLimits = StoreLimits(),
                 device: str | torch.device = "cpu", digest: ReadDigest | None = None) -> BoundAdapter:
    """The adapter at `location` read, converted, checked against `model` (its declared base
    model too) and bound to its layers, packed on `device` where it was read in place: what
    the store caches, and what the benchmarks use. `digest`: hashes its weights file from the
    bytes the read brings in (`digest.result`, once read)."""
    return _parse_and(location, model, limits, lambda parsed: bind_adapter(parsed, model.layers, limits.max_rank,
                                                                           model.dtype, device), digest)


def _unchanged(location: AdapterLocation, stamp: tuple) -> bool:
    """Whether the adapter's file is still the one stamped `stamp` (so the digest of what was read is its own)."""
    try:
        return file_stamp(location) == stamp
    except AdapterError:  # removed meanwhile
        return False


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
               use: Callable[[ParsedAdapter], T], digest: ReadDigest | None = None) -> T:
    """`use` the adapter parsed for `model`. Read in place (the large factors read from the
    file only when packed, straight into their place: one copy), unless the parse or `use`
    needs the values of a factor standing in (one the parse computes): then read whole."""
    try:
        return _parsed_use(location, model, limits, use, True, digest)
    except (NotInFile, RuntimeError, NotImplementedError) as e:  # RuntimeError: a value asked of a stand-in
        logger.debug("adapter %s read whole (%s)", location.adapter_id, e)
        return _parsed_use(location, model, limits, use, False, digest)


def _parsed_use(location: AdapterLocation, model: TargetModel, limits: StoreLimits, use: Callable[[ParsedAdapter], T],
                in_place: bool, digest: ReadDigest | None) -> T:
    try:
        parsed = parse_adapter_file(location, model.pipeline_cls, model.layers.component_modules,
                                    limits.max_adapter_bytes, model.unet_config, in_place, digest)
    except BaseException:
        if digest is not None:
            digest.cancel()
        raise
    try:
        refuse_other_base(location.adapter_id, parsed.base_models, [model.name])
        used = use(parsed)
        if digest is not None:  # (the rest of the file read from it while it is open)
            digest.finish()
        return used
    except BaseException:
        if digest is not None:
            digest.cancel()
        raise
    finally:
        for file in parsed.files:
            file.close()
