"""Soak: 1,000 swaps over 50 adapters (every 10th with a 1-step image), as the GPU worker
does them, with a host cache that holds about a third of the adapters (so adapters are
evicted and read again all along).

Process RSS may grow less than 2 % after warm-up; at the end the base weights are bitwise
the originals, an adapter fuses bitwise as it did the first time, and the cache holds
nothing in use and stays within its budget.
"""

import gc
import random
import time

import psutil
import pytest
import torch
from support.numerics import assert_bitwise_equal, weights_snapshot

from loraswap.adapters.cache import CacheConfig, Tier
from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest

ADAPTERS = 50
SWAPS = 1000
WARMUP = 200  # every adapter read at least once, the cache full and evicting
MAX_RSS_GROWTH = 0.02


@pytest.mark.soak
def test_1000_swaps_over_50_adapters_keep_memory_flat_and_the_base_exact(adapter_factory, tmp_path):
    specs = [(4, "attn", "diffusers", False), (8, "all", "diffusers", True), (16, "attn", "kohya", False),
             (4, "all", "kohya", True), (32, "attn", "diffusers", False)]
    for i in range(ADAPTERS):
        rank, targets, fmt, text_encoder = specs[i % len(specs)]
        adapter_factory(f"a{i:02d}", "tiny-sd", rank=rank, targets=targets, fmt=fmt, text_encoder=text_encoder,
                        alpha=2.0 * rank, seed=1000 + i, folder=tmp_path)
    sizing = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    total = sum(sizing.adapters.read(AdapterRef(f"a{i:02d}")).nbytes for i in range(ADAPTERS))
    del sizing
    budget = total // 3
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False,
                                 cache=CacheConfig(host_bytes=budget, gpu_bytes=0)))
    base = weights_snapshot(engine.components)

    rng = random.Random(0)
    process = psutil.Process()
    rss, first_a00, swaps, images, previous = {}, None, 0, 0, None
    started = time.perf_counter()
    for i in range(SWAPS):
        while True:  # every step changes what is fused: 5 % base, 10 % blends of two, else one adapter
            roll = rng.random()
            ids = [] if roll < 0.05 else rng.sample(range(ADAPTERS), 2 if roll < 0.15 else 1)
            loras = [(f"a{k:02d}", round(rng.uniform(0.3, 1.0), 2)) for k in ids]
            if loras != previous:
                break
        loras = [("a00", 1.0)] if i == 0 else loras
        previous = loras
        # what the GPU worker does for a request: a lease of its adapters read on the store's
        # threads, the swap, every 10th time a 1-step 16x16 image, then the lease given back
        with engine.lender.lease(as_refs(loras)).result(timeout=60) as lease:
            swaps += engine.apply(lease) > 0
            if i % 10 == 0:
                request = GenerateRequest(prompt="soak", seed=i, steps=1, width=16, height=16, loras=loras)
                images += engine.generate_batch([request], lease)[0].image.size == (16, 16)
        if i == 0:
            first_a00 = weights_snapshot(engine.components)
        if i + 1 == WARMUP or (i + 1) % 100 == 0:
            gc.collect()
            rss[i + 1] = process.memory_info().rss
    seconds = time.perf_counter() - started

    growth = rss[SWAPS] / rss[WARMUP] - 1
    cache = engine.adapters.cache
    table = cache.table()
    print(f"\nsoak: {swaps} swaps and {images} images in {seconds:.1f} s, "
          f"RSS after warm-up {rss[WARMUP] / 2**20:.1f} MiB, at the end {rss[SWAPS] / 2**20:.1f} MiB "
          f"({growth * 100:+.2f} %), cache misses {cache.misses}, hits {sum(cache.hits.values())}; "
          f"RSS MiB by request: {', '.join(f'{k}: {v / 2**20:.1f}' for k, v in rss.items())}")
    assert swaps == SWAPS and images == SWAPS // 10, "every step swapped; every 10th generated"
    assert engine.adapters.cache.misses > 2 * ADAPTERS, "adapters were evicted and read again"
    assert growth < MAX_RSS_GROWTH, f"RSS grew {growth * 100:.2f} % after warm-up"
    assert all(row["in_use"] == 0 for row in table), "a request left an adapter held in the cache"
    assert engine.adapters.cache.peak_bytes[Tier.HOST.value] <= budget
    # the same adapter fuses to the same bits as the first time; no drift in 1,000 swaps
    engine.set_adapters([("a00", 1.0)])
    assert_bitwise_equal(first_a00, engine.components)
    engine.set_adapters([])
    assert_bitwise_equal(base, engine.components)
    assert not torch.equal(first_a00["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
                           base["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"])


@pytest.mark.soak
def test_reading_an_adapter_again_and_again_keeps_nothing_alive(adapter_factory, tmp_path):
    """safetensors 0.8.0's default (mmap) loading keeps ~10 KB of Python objects alive per file
    read; a server that re-reads evicted adapters all day must not (formats.read_safetensors)."""
    import tracemalloc

    from loraswap.adapters.files.formats import read_safetensors

    path = adapter_factory("reread", "tiny-sd", rank=8, targets="all", text_encoder=True, folder=tmp_path)
    for _ in range(20):
        read_safetensors(path, "reread", 2**30)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            read_safetensors(path, "reread", 2**30)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    per_read = sum(stat.size_diff for stat in after.compare_to(before, "filename")) / 200
    print(f"\nPython memory kept per adapter read: {per_read:.0f} B")
    assert per_read < 500, f"{per_read:.0f} B kept alive per read"
