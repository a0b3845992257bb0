"""Prometheus metrics, in a registry owned by the app (no module-level state).

Request counts and the swap / generate histograms are observed at the HTTP edge; engine
and worker figures come from the backend at scrape time (`render(figures)`): summed over
the engines of this process, or over the model replicas of a Ray deployment, with a few
per-replica series for the latter. The app's URL book (`url_book.UrlBook`) is read at scrape
time too: how much of its bounds it takes, and how many URLs requests in flight hold.
"""

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraswap.adapters.cache import Tier

SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GENERATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass
class EngineFigures:
    """Engine and worker figures for /metrics, summed over the engines serving."""

    recompiles: int = 0
    cache_hits: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in (Tier.HOST, Tier.GPU)})
    cache_misses: int = 0
    cache_bytes: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in (Tier.HOST, Tier.GPU)})
    queue_depth: int = 0
    cancelled: int = 0
    ready: bool = False
    replicas: list[dict] = field(default_factory=list)  # Ray: one row per model replica
    # per model: start-up seconds by phase (`Engine.startup_seconds`) and torch's compile cache lookups
    # until its first image (`Engine.compile_cache_lookups`); the slowest replica's, the lookups summed
    startup: dict[str, dict[str, float]] = field(default_factory=dict)
    compile_cache: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, engine, worker) -> "EngineFigures":
        """One engine's figures (an `Engine` and its `GpuWorker`)."""
        cache = engine.adapters.cache
        lookups = engine.compile_cache_lookups
        return cls(recompiles=engine.recompiles, cache_misses=cache.misses,
                   cancelled=worker.skipped_cancelled + worker.stopped,
                   cache_hits={t.value: cache.hits[t.value] for t in (Tier.HOST, Tier.GPU)},
                   cache_bytes={t.value: cache.used(t) for t in (Tier.HOST, Tier.GPU)},
                   queue_depth=worker.queue_depth, ready=True,
                   startup={engine.model_name: dict(engine.startup_seconds)},
                   compile_cache={engine.model_name: lookups} if lookups else {})

    def add(self, other: "EngineFigures", gauges: bool = True) -> None:
        """Add another engine's counters (and its gauges unless it is gone)."""
        self.recompiles += other.recompiles
        self.cache_misses += other.cache_misses
        self.cancelled += other.cancelled
        _add_into(self.cache_hits, other.cache_hits)
        if not gauges:
            return
        self.queue_depth += other.queue_depth
        _add_into(self.cache_bytes, other.cache_bytes)
        for model, phases in other.startup.items():
            mine = self.startup.setdefault(model, {})
            for phase, seconds in phases.items():
                mine[phase] = max(mine.get(phase, 0.0), seconds)
        for model, caches in other.compile_cache.items():
            mine = self.compile_cache.setdefault(model, {})
            for cache, results in caches.items():
                _add_into(mine.setdefault(cache, {}), results)


def _add_into(total: dict, more: dict) -> None:
    for key, n in more.items():
        total[key] = total.get(key, 0) + n


class Metrics:
    def __init__(self, urls=None):
        """`urls`: the app's `url_book.UrlBook`, reported at each scrape (None: not reported)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("loraswap_requests", "HTTP generation requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.swap_seconds = Histogram("loraswap_adapter_swap_seconds", "Time to put adapters on the model.",
                                      buckets=SWAP_BUCKETS, registry=self.registry)
        self.step_cache_steps = Counter("loraswap_step_cache_steps", "Denoising steps run with a step cache, by "
                                        "method and outcome (skipped: a cache stood in; computed).",
                                        ["method", "outcome"], registry=self.registry)
        self.generate_seconds = Histogram("loraswap_generate_seconds", "Pipeline time per image.",
                                          buckets=GENERATE_BUCKETS, registry=self.registry)
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
        self.registry.register(_GpuMemoryCollector())
        if urls is not None:
            self.registry.register(_UrlBookCollector(urls))
        self._lock = threading.Lock()

    def render(self, figures: EngineFigures) -> bytes:
        """The Prometheus text, with these engine figures."""
        with self._lock:
            self._engines.figures = figures
            return generate_latest(self.registry)


def gpu_memory() -> list[dict]:
    """This process's GPU memory per visible device, now and at its peak (torch's allocator):
    what `--max-gpu-memory-gb` budgets. Empty without CUDA (a Ray ingress: Ray hides the GPUs
    from actors that asked for none)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [{"device": str(index), "allocated_bytes": torch.cuda.memory_allocated(index),
             "peak_bytes": torch.cuda.max_memory_allocated(index)} for index in range(torch.cuda.device_count())]


class _GpuMemoryCollector:
    """`gpu_memory()` of the process serving /metrics (the plain server's engines)."""

    def collect(self):
        rows = gpu_memory()
        if not rows:
            return
        allocated = GaugeMetricFamily("loraswap_gpu_memory_bytes", "GPU memory allocated by this process.",
                                      labels=["device"])
        peak = GaugeMetricFamily("loraswap_gpu_memory_peak_bytes", "Most GPU memory this process has allocated.",
                                 labels=["device"])
        for row in rows:
            allocated.add_metric([row["device"]], row["allocated_bytes"])
            peak.add_metric([row["device"]], row["peak_bytes"])
        yield from (allocated, peak)


class _UrlBookCollector:
    """The URLs behind `url:` ids that the server remembers: what its bounds (`url_book.MAX_URLS`,
    `MAX_BYTES`) are measured against, and the URLs held by requests not yet answered (none
    once the server is idle: a URL left held would never be dropped)."""

    def __init__(self, book):
        self.book = book

    def collect(self):
        urls, size, held_urls = self.book.figures()  # one moment: never more held than remembered
        remembered = GaugeMetricFamily("loraswap_url_book_urls", "URLs behind url: ids the server remembers "
                                       "(held, kept or pinned).")
        remembered_bytes = GaugeMetricFamily("loraswap_url_book_bytes", "Memory the remembered URLs take.")
        held = GaugeMetricFamily("loraswap_url_book_held_urls", "URLs held by requests not yet answered.")
        remembered.add_metric([], urls)
        remembered_bytes.add_metric([], size)
        held.add_metric([], held_urls)
        yield from (remembered, remembered_bytes, held)


class _EngineCollector:
    def __init__(self):
        self.figures = None

    def collect(self):
        f = self.figures
        if f is None:
            return
        recompiles = CounterMetricFamily("loraswap_recompiles", "Graphs compiled after warm-up (should stay 0).")
        hits = CounterMetricFamily("loraswap_adapter_cache_hits", "Adapter lookups served from the cache, by tier.",
                                   labels=["tier"])
        misses = CounterMetricFamily("loraswap_adapter_cache_misses", "Adapter lookups read from disk.")
        depth = GaugeMetricFamily("loraswap_queue_depth", "Requests waiting for the GPU workers.")
        skipped = CounterMetricFamily("loraswap_cancelled_requests", "Requests cancelled (client gone, video "
                                      "deleted): dropped while queued, or stopped at a step.")
        ready = GaugeMetricFamily("loraswap_ready", "1 when every model is warm and serving.")
        cache_bytes = GaugeMetricFamily("loraswap_adapter_cache_bytes", "Bytes held by each cache tier.",
                                        labels=["tier"])
        recompiles.add_metric([], f.recompiles)
        for tier, value in f.cache_hits.items():
            hits.add_metric([tier], value)
        for tier, value in f.cache_bytes.items():
            cache_bytes.add_metric([tier], value)
        misses.add_metric([], f.cache_misses)
        depth.add_metric([], f.queue_depth)
        skipped.add_metric([], f.cancelled)
        ready.add_metric([], 1 if f.ready else 0)
        yield from (recompiles, hits, misses, depth, skipped, ready, cache_bytes)
        yield from _startup_families(f.startup, f.compile_cache)
        if f.replicas:
            yield from _replica_families(f.replicas)


def _startup_families(startup: dict[str, dict[str, float]], compile_cache: dict[str, dict[str, dict[str, int]]]):
    """How each model started: seconds by phase, and torch's compile cache lookups until its first image."""
    seconds = GaugeMetricFamily("loraswap_startup_seconds", "Start-up of each model, seconds from its start: load "
                                "(pipeline on the device), warmup (compile + warm-up image), first_image.",
                                labels=["model", "phase"])
    lookups = GaugeMetricFamily("loraswap_compile_cache_lookups", "torch.compile cache lookups until the model's "
                                "first image, by cache (fxgraph, aotautograd) and result (hit, miss, bypass).",
                                labels=["model", "cache", "result"])
    for model, phases in startup.items():
        for phase, value in phases.items():
            seconds.add_metric([model, phase.removesuffix("_s")], value)
    for model, caches in compile_cache.items():
        for cache, results in caches.items():
            for result, n in results.items():
                lookups.add_metric([model, cache, result], n)
    yield from (seconds, lookups)


def _replica_families(replicas: list[dict]):
    """Per-replica series of a Ray deployment (rows from `cluster.reports`)."""
    labels = ["model", "replica"]
    up = GaugeMetricFamily("loraswap_replica_up", "1 while the replica reports; 0 once it stopped or died.",
                           labels=labels)
    loads = CounterMetricFamily("loraswap_replica_adapter_loads", "Adapters put into the replica's adapter budget.",
                                labels=labels)
    evictions = CounterMetricFamily("loraswap_replica_adapter_evictions",
                                    "Adapters evicted (least recently used) when the replica's budget was full.",
                                    labels=labels)
    held = GaugeMetricFamily("loraswap_replica_adapters", "Adapters held by the replica (its budget's use).",
                             labels=labels)
    served = CounterMetricFamily("loraswap_replica_requests", "Images generated by the replica.", labels=labels)
    misses = CounterMetricFamily("loraswap_replica_adapter_cache_misses", "Adapter reads from disk by the replica.",
                                 labels=labels)
    startup = GaugeMetricFamily("loraswap_replica_startup_seconds", "Start-up of the replica's engine by phase "
                                "(as loraswap_startup_seconds).", labels=[*labels, "phase"])
    gpu = GaugeMetricFamily("loraswap_replica_gpu_memory_bytes", "GPU memory the replica's process has allocated, "
                            "by device index (as loraswap_gpu_memory_bytes).", labels=[*labels, "device"])
    gpu_peak = GaugeMetricFamily("loraswap_replica_gpu_memory_peak_bytes", "Most GPU memory the replica's process "
                                 "has allocated (as loraswap_gpu_memory_peak_bytes).", labels=[*labels, "device"])
    for row in replicas:
        key = [row["model"], row["replica"]]
        up.add_metric(key, 1 if row["alive"] else 0)
        loads.add_metric(key, row["loads"])
        evictions.add_metric(key, row["evictions"])
        held.add_metric(key, len(row["held"]) if row["alive"] else 0)
        served.add_metric(key, row["served"])
        misses.add_metric(key, row["figures"].cache_misses)
        for phases in row["figures"].startup.values():
            for phase, seconds in phases.items():
                startup.add_metric([*key, phase.removesuffix("_s")], seconds)
        for device in row.get("gpus", []) if row["alive"] else []:  # a gone replica's memory is freed
            gpu.add_metric([*key, device["device"]], device["allocated_bytes"])
            gpu_peak.add_metric([*key, device["device"]], device["peak_bytes"])
    yield from (up, loads, evictions, held, served, misses, startup, gpu, gpu_peak)
