"""The tiered adapter cache: host RAM, then GPU, each with a byte budget.

Adapters ready to fuse (bound, packed factors) live in the host tier; the hottest also
have a copy in the GPU tier, so a swap needs no host-to-GPU copy. On CUDA a freshly read
adapter arrives on the GPU (`device_read.py`, when `start_gpu_read` gives it a turn) or in
pageable host memory, and its pinned host copy is made afterwards by one background
thread, off the request's path: pinning costs more than the read (bench/results/runs/2026-12-03-request-sdxl-h200.md),
and only swaps from the host tier need it. The GPU tier is a subset of the host tier,
and its budget may not exceed the host budget (checked when the config is built).

Eviction is least-recently-used by bytes and never touches an entry that is kept
(`POST /adapters/{id}/load`) or in use (acquired by a queued request until its swap is
done). When nothing can be evicted, `insert` waits for space instead of overshooting;
an adapter larger than the whole host budget is served without being cached.
"""

import contextlib
import enum
import itertools
import logging
import threading
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import BaseModel, Field, model_validator

from loraswap.adapters.bound import BoundAdapter
from loraswap.adapters.files.hashes import FileDigest
from loraswap.flags import ADAPTERS, Flag

logger = logging.getLogger(__name__)
GPU_READS = 2  # adapters read straight to the GPU at once, or waiting there for their host copy


class Tier(str, enum.Enum):
    DISK = "disk"
    HOST = "host"
    GPU = "gpu"


class CacheConfig(BaseModel):
    host_bytes: Annotated[int, Flag(ADAPTERS, name="host-cache-mb", unit="MiB", scale=2**20)] = Field(
        8 * 2**30, ge=0, description="Host RAM for adapters ready to fuse.")
    gpu_bytes: Annotated[int, Flag(ADAPTERS, name="gpu-cache-mb", unit="MiB", scale=2**20)] = Field(
        2 * 2**30, ge=0, description="GPU memory for adapter copies (at most the host cache's).")

    @model_validator(mode="after")
    def _gpu_within_host(self):
        if self.gpu_bytes > self.host_bytes:
            raise ValueError(f"the GPU adapter budget ({self.gpu_bytes} B) exceeds the host budget "
                             f"({self.host_bytes} B): every GPU copy is also held in host RAM")
        return self


@dataclass
class CacheEntry:
    adapter_id: str
    stamp: tuple  # (size, mtime_ns, ctime_ns, inode) of the file it was read from
    host: BoundAdapter
    gpu: BoundAdapter | None = None
    gpu_ready: object = None  # torch.cuda.Event after which `gpu` holds the factors
    kept: bool = False  # never evicted until `evict` (POST /adapters/{id}/load)
    in_use: int = 0
    last_used: int = 0
    cached: bool = True  # False: larger than the host budget, served once and dropped
    digest: FileDigest | None = None  # the file's SHA-256, for the images' records (None: not known)

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    @property
    def tier(self) -> Tier:
        return Tier.GPU if self.gpu is not None else Tier.HOST

    def best(self) -> BoundAdapter:
        """The GPU copy once its copy has been ordered on the current stream, else the host one."""
        if self.gpu is not None:
            if self.gpu_ready is not None:
                torch.cuda.current_stream().wait_event(self.gpu_ready)
            return self.gpu
        return self.host


class AdapterCache:
    def __init__(self, config: CacheConfig, device: torch.device):
        self.config = config
        self.device = device
        self._entries: dict[str, CacheEntry] = {}
        self._lock = threading.Condition()
        self._clock = itertools.count(1)
        self.hits: Counter = Counter()  # tier -> count
        self.misses = 0
        self.peak_bytes: Counter = Counter()  # tier -> the most it ever held
        self.pin_host = device.type == "cuda"  # host copies pinned after insertion (`_pin_later`)
        # copies up to the GPU tier and down to host RAM, each on a side stream of its own: neither
        # waits for the other, nor for the GPU worker's kernels
        self._up = self._down = None
        if self.pin_host:
            self._up, self._down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self._pinner = ThreadPoolExecutor(1, thread_name_prefix="loraswap-pin")
        self._gpu_reads = threading.BoundedSemaphore(GPU_READS)

    def close(self) -> None:
        self._pinner.shutdown(wait=False, cancel_futures=True)

    def finish_pinning(self) -> None:
        """Wait until every host copy queued for pinning is pinned (or left the cache): for
        benchmarks and tests that look at pinned buffers."""
        self._pinner.submit(lambda: None).result()

    # ---------------------------------------------------------------- lookups
    def lookup(self, adapter_id: str, stamp: tuple) -> CacheEntry | None:
        """The entry, held (in use) until `release`, if cached from the same file version;
        counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None and entry.stamp != stamp:
                self._drop(entry)  # the file changed on disk: re-read it
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self.hits[entry.tier.value] += 1
            entry.last_used = next(self._clock)
            entry.in_use += 1
            return entry

    def insert(self, adapter_id: str, host: BoundAdapter, stamp: tuple, timeout: float = 600.0) -> CacheEntry:
        """Cache a freshly read adapter in the host tier, evicting or waiting for space;
        the entry is held (in use) until `release`. On CUDA its host copy is pinned later."""
        entry = CacheEntry(adapter_id, stamp, host, last_used=next(self._clock), in_use=1)
        with self._lock:
            old = self._entries.get(adapter_id)
            if old is not None and old.stamp == stamp:  # read twice at once: keep the first
                old.in_use += 1
                return old
            if old is not None:
                self._drop(old)
            if entry.nbytes > self.config.host_bytes:
                logger.warning("adapter %s (%d B) exceeds the host cache budget: served uncached",
                               adapter_id, entry.nbytes)
                entry.cached = False
                return entry
            if not self._lock.wait_for(lambda: self._make_room(Tier.HOST, entry.nbytes), timeout):
                raise TimeoutError("no host cache space was freed in time")
            self._entries[adapter_id] = entry
            self.peak_bytes[Tier.HOST.value] = max(self.peak_bytes[Tier.HOST.value], self._used(Tier.HOST))
            if self.pin_host:  # by reference only: an entry evicted before its turn frees its copy
                self._pinner.submit(self._pin_later, weakref.ref(entry))
            return entry

    def _pin_later(self, ref: "weakref.ref[CacheEntry]") -> None:
        """Replace the entry's pageable host copy by a pinned one, unless it left the cache.
        For a moment the adapter is in host RAM twice, pageable and pinned. A copy read
        straight to the GPU (`start_gpu_read`) is copied down here, on the side stream (the
        GPU worker's kernels neither wait for it nor it for them)."""
        entry = ref()
        if entry is None or not self.holds(entry):
            return
        on_gpu = entry.host.device.type != "cpu"
        try:
            with torch.cuda.stream(self._down) if on_gpu else contextlib.nullcontext():
                self.replace_host(entry, entry.host.to("cpu", pin_memory=True))
        except Exception:  # out of pinnable memory, say: a pageable copy serves
            logger.warning("could not pin adapter %s in host RAM; it stays pageable", entry.adapter_id,
                           exc_info=True)
            if on_gpu:
                self._copy_down_or_drop(entry)

    def _copy_down_or_drop(self, entry: CacheEntry) -> None:
        """A host copy still on the GPU, copied to pageable RAM; failing that, out of the cache
        (read again when next asked for) rather than held on the GPU for good."""
        try:
            with torch.cuda.stream(self._down):
                self.replace_host(entry, entry.host.to("cpu"))
        except Exception:
            logger.warning("could not copy adapter %s to host RAM; dropped from the cache", entry.adapter_id,
                           exc_info=True)
            with self._lock:
                self._drop(entry)
                self._lock.notify_all()

    def start_gpu_read(self, nbytes: int) -> bool:
        """Whether a never-seen adapter of `nbytes` may be read straight to the GPU
        (`device_read`): on CUDA, when the GPU tier could hold it, and while fewer than
        `GPU_READS` such copies wait for their host copy (each holds GPU memory outside the
        budgets until then). True takes a turn, which `end_gpu_read` gives back."""
        return self.pin_host and nbytes <= self.config.gpu_bytes and self._gpu_reads.acquire(blocking=False)

    def end_gpu_read(self) -> None:
        self._gpu_reads.release()

    def maybe_copy_to_gpu(self, entry: CacheEntry) -> None:
        """Give the entry a GPU copy (side stream) when the GPU budget allows; else nothing."""
        if self.device.type != "cuda" or not entry.cached or entry.gpu is not None:
            return
        with self._lock:
            if entry.nbytes > self.config.gpu_bytes or not self._make_room(Tier.GPU, entry.nbytes):
                return
            if entry.host.packed is not None and entry.host.packed.is_cuda:  # read to the GPU: complete already
                gpu, event = entry.host.to(self.device), None  # (another object on the same buffer: no copy)
            else:
                with torch.cuda.stream(self._up):
                    gpu = entry.host.to(self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                gpu.packed.record_stream(self._up)
            entry.gpu, entry.gpu_ready = gpu, event
            self.peak_bytes[Tier.GPU.value] = max(self.peak_bytes[Tier.GPU.value], self._used(Tier.GPU))

    # ---------------------------------------------------------------- use, keep and evict
    def release(self, entry: CacheEntry) -> None:
        with self._lock:
            entry.in_use = max(0, entry.in_use - 1)
            self._lock.notify_all()

    def keep(self, adapter_id: str) -> bool:
        """Never evict the adapter (until `evict`); False when it is not cached."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None:
                return False
            entry.kept = True
            return True

    def evict(self, adapter_id: str) -> None:
        """Stop keeping the adapter and drop it (unless a queued request still holds it)."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                entry.kept = False
                if entry.in_use == 0:
                    self._drop(entry)
            self._lock.notify_all()

    # ---------------------------------------------------------------- accounting
    def used(self, tier: Tier) -> int:
        with self._lock:
            return self._used(tier)

    def table(self) -> list[dict]:
        """One row per cached adapter, most recently used first."""
        with self._lock:
            rows = sorted(self._entries.values(), key=lambda e: -e.last_used)
            return [{"id": e.adapter_id, "tier": e.tier.value, "bytes": e.nbytes, "kept": e.kept,
                     "in_use": e.in_use} for e in rows]

    def get(self, adapter_id: str) -> CacheEntry | None:
        with self._lock:
            return self._entries.get(adapter_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def holds(self, entry: CacheEntry) -> bool:
        with self._lock:
            return self._entries.get(entry.adapter_id) is entry

    def replace_host(self, entry: CacheEntry, host: BoundAdapter) -> bool:
        """Give a cached entry another host copy of the same factors (pinned for pageable);
        False, changing nothing, once the entry has left the cache. A swap already using the
        old copy keeps it alive until done."""
        if host.nbytes != entry.host.nbytes or host.adapter_id != entry.adapter_id:
            raise ValueError(f"not the same factors as adapter {entry.adapter_id}'s host copy")
        with self._lock:
            if self._entries.get(entry.adapter_id) is not entry:
                return False
            entry.host = host
            return True

    def _used(self, tier: Tier) -> int:
        entries = self._entries.values()
        if tier is Tier.GPU:
            return sum(e.nbytes for e in entries if e.gpu is not None)
        return sum(e.nbytes for e in entries)

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        """Evict LRU entries (or their GPU copies) until `nbytes` fit; False if they cannot."""
        budget = self.config.host_bytes if tier is Tier.HOST else self.config.gpu_bytes
        if self._used(tier) + nbytes <= budget:
            return True
        holders = [e for e in self._entries.values() if (tier is Tier.HOST or e.gpu is not None)
                   and not e.kept and e.in_use == 0]
        for victim in sorted(holders, key=lambda e: e.last_used):
            if tier is Tier.HOST:
                self._drop(victim)
            else:
                victim.gpu, victim.gpu_ready = None, None
            if self._used(tier) + nbytes <= budget:
                return True
        return False

    def _drop(self, entry: CacheEntry) -> None:
        if self._entries.get(entry.adapter_id) is entry:
            del self._entries[entry.adapter_id]
        entry.gpu, entry.gpu_ready = None, None
