"""Prometheus metrics, in a registry owned by the app (no module-level state)."""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..adapters.cache import Tier

SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
GENERATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class Metrics:
    def __init__(self, state):
        """`state` is the app state: read at scrape time for engine and worker figures."""
        self.registry = CollectorRegistry()
        self.requests = Counter("loraswap_requests", "HTTP generation requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.swap_seconds = Histogram("loraswap_adapter_swap_seconds", "Time to put adapters on the model.",
                                      buckets=SWAP_BUCKETS, registry=self.registry)
        self.generate_seconds = Histogram("loraswap_generate_seconds", "Pipeline time per image.",
                                          buckets=GENERATE_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(state))


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        """Figures summed over the hosted models (one engine and worker each)."""
        deployment = getattr(self.state, "deployment", None)
        hosted = deployment.hosted if deployment is not None else []
        engines, workers = [h.engine for h in hosted], [h.worker for h in hosted]
        recompiles = CounterMetricFamily("loraswap_recompiles", "Graphs compiled after warm-up (should stay 0).")
        hits = CounterMetricFamily("loraswap_adapter_cache_hits", "Adapter lookups served from the cache, by tier.",
                                   labels=["tier"])
        misses = CounterMetricFamily("loraswap_adapter_cache_misses", "Adapter lookups read from disk.")
        depth = GaugeMetricFamily("loraswap_queue_depth", "Requests waiting for the GPU workers.")
        skipped = CounterMetricFamily("loraswap_cancelled_requests", "Queued requests dropped: client gone.")
        ready = GaugeMetricFamily("loraswap_ready", "1 when every model is warm and serving.")
        cache_bytes = GaugeMetricFamily("loraswap_adapter_cache_bytes", "Bytes held by each cache tier.",
                                        labels=["tier"])
        recompiles.add_metric([], sum(e.recompiles for e in engines))
        for tier in (Tier.HOST, Tier.GPU):
            hits.add_metric([tier.value], sum(e.cache.hits[tier.value] for e in engines))
            cache_bytes.add_metric([tier.value], sum(e.cache.used(tier) for e in engines))
        misses.add_metric([], sum(e.cache.misses for e in engines))
        depth.add_metric([], sum(w.queue_depth for w in workers))
        skipped.add_metric([], sum(w.skipped_cancelled for w in workers))
        ready.add_metric([], 1 if hosted else 0)
        yield from (recompiles, hits, misses, depth, skipped, ready, cache_bytes)
