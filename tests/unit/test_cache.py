"""The tiered adapter cache: the table after every load, touch, keep and eviction."""

import threading

import pytest
import torch
from support.adapters import MB, adapter

from loraswap.adapters.cache import AdapterCache, CacheConfig, Tier


def rows(cache):
    return [(r["id"], r["tier"], r["bytes"] // MB, r["kept"], r["in_use"]) for r in cache.table()]


def test_gpu_budget_may_not_exceed_host_budget():
    with pytest.raises(ValueError, match="exceeds the host budget"):
        CacheConfig(host_bytes=10 * MB, gpu_bytes=20 * MB)


def test_lru_by_bytes_with_kept_and_in_use_entries():
    cache = AdapterCache(CacheConfig(host_bytes=10 * MB, gpu_bytes=0), torch.device("cpu"))
    a = cache.insert("a", adapter("a", 4), (1,))
    assert rows(cache) == [("a", "host", 4, False, 1)]
    cache.release(a)
    b = cache.insert("b", adapter("b", 4), (1,))
    cache.release(b)
    assert rows(cache) == [("b", "host", 4, False, 0), ("a", "host", 4, False, 0)]
    # touch a: most recently used first
    cache.release(cache.lookup("a", (1,)))
    assert rows(cache) == [("a", "host", 4, False, 0), ("b", "host", 4, False, 0)]
    assert (cache.hits["host"], cache.misses) == (1, 0)
    # c does not fit: the least recently used (b) goes
    c = cache.insert("c", adapter("c", 4), (1,))
    assert rows(cache) == [("c", "host", 4, False, 1), ("a", "host", 4, False, 0)]
    # keep a, hold c in use: d cannot make room, and waits instead of overshooting
    assert cache.keep("a")
    assert rows(cache) == [("c", "host", 4, False, 1), ("a", "host", 4, True, 0)]
    with pytest.raises(TimeoutError):
        cache.insert("d", adapter("d", 4), (1,), timeout=0.2)
    assert rows(cache) == [("c", "host", 4, False, 1), ("a", "host", 4, True, 0)]
    # released in another thread: d gets c's place
    threading.Timer(0.1, cache.release, args=(c,)).start()
    d = cache.insert("d", adapter("d", 4), (1,), timeout=5)
    assert rows(cache) == [("d", "host", 4, False, 1), ("a", "host", 4, True, 0)]
    assert cache.used(Tier.HOST) == 8 * MB <= 10 * MB
    assert cache.peak_bytes["host"] == 8 * MB
    # evict drops it; a stale file version is a miss and replaces the entry
    cache.evict("a")
    assert rows(cache) == [("d", "host", 4, False, 1)]
    cache.release(d)
    assert cache.lookup("d", (2,)) is None
    assert rows(cache) == [] and cache.misses == 1
    # larger than the whole budget: served, never cached
    big = cache.insert("big", adapter("big", 12), (1,))
    assert not big.cached and rows(cache) == []


def test_same_adapter_read_twice_at_once_is_cached_once():
    cache = AdapterCache(CacheConfig(host_bytes=10 * MB, gpu_bytes=0), torch.device("cpu"))
    first = cache.insert("a", adapter("a", 4), (1,))
    second = cache.insert("a", adapter("a", 4), (1,))
    assert second is first and rows(cache) == [("a", "host", 4, False, 2)]

