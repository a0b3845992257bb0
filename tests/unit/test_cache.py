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



def test_a_failed_gpu_read_is_read_on_the_host_and_gives_its_turn_back(tmp_path, monkeypatch, caplog):
    """The store reads a never-seen adapter straight to the GPU only when the cache gives it a
    turn (at most two at once, and only what the GPU tier could hold); a read that fails on
    the GPU (out of memory, say) is read on the host with a warning, its turn given back."""
    from safetensors.torch import save_file

    from loraswap.adapters import store as store_module
    from loraswap.adapters.bound import ModelLayers
    from loraswap.adapters.files.device_read import DeviceReadFailed
    from loraswap.adapters.random import make_random_adapter
    from loraswap.adapters.reference import AdapterRef
    from loraswap.adapters.sources.choose import AdapterSources
    from loraswap.adapters.sources.folder import FolderSource
    from loraswap.models import lora_components

    cls, components = lora_components("tiny-sd")
    state_dict, metadata = make_random_adapter(components, 4, "attn")
    save_file(state_dict, str(tmp_path / "a.safetensors"), metadata=metadata)
    target = store_module.TargetModel("tiny-sd", cls, ModelLayers(components), torch.float32)
    store = store_module.AdapterStore(AdapterSources(FolderSource(tmp_path), None, None), target,
                                      CacheConfig(gpu_bytes=MB), torch.device("cpu"))
    store.cache.pin_host = True  # as on CUDA
    read = store_module.read_adapter
    devices = []

    def gpu_fails(location, model, limits, device=None, digest=None):  # the read to the GPU names the cache's device
        devices.append(device)
        if device is not None:
            raise DeviceReadFailed("OutOfMemoryError: CUDA out of memory")
        return read(location, model, limits, digest=digest)

    monkeypatch.setattr(store_module, "read_adapter", gpu_fails)
    bound = store.read(AdapterRef("a"))
    assert devices == [store.cache.device, None] and bound.packed.device.type == "cpu"
    assert "could not be read to the GPU (OutOfMemoryError" in caplog.text
    assert [store.cache.start_gpu_read(1) for _ in range(3)] == [True, True, False], "both turns back, one taken"
    store.cache.end_gpu_read(), store.cache.end_gpu_read()
    assert not store.cache.start_gpu_read(MB + 1), "larger than the GPU tier: read on the host"
    store.close()
