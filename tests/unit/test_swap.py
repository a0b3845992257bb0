"""The fused swapper's own guarantees: packed factors, idempotence, pristine bookkeeping."""

import torch
from support.numerics import assert_bitwise_equal, weights_snapshot

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine


def test_packed_factors_fuse_exactly_like_unpacked(adapter_factory, tmp_path):
    adapter_factory("p1", "tiny-sdxl", rank=16, targets="all", text_encoder=True, seed=80, folder=tmp_path)
    adapter_factory("p2", "tiny-sdxl", rank=4, targets="attn", seed=81, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sdxl", adapters=tmp_path, compile=False, warmup=False))
    base = weights_snapshot(engine.components)
    p1, p2 = engine.adapters.read(AdapterRef("p1")), engine.adapters.read(AdapterRef("p2"))
    engine.swapper.apply([(p1, 0.7), (p2, 0.4)])
    unpacked = weights_snapshot(engine.components)

    packed1, packed2 = p1.to("cpu", torch.float32), p2.to("cpu", torch.float32)
    factors = sum(layer.down.numel() + layer.up.numel() for layer in p1.layers.values())
    assert packed1.packed is not None and factors <= packed1.packed.numel() <= factors + 14 * len(p1.layers)
    # every factor is a view into the one buffer, starting 16-byte aligned (the swap kernel's vector loads)
    start, end = packed1.packed.data_ptr(), packed1.packed.data_ptr() + packed1.packed.nbytes
    for layer in packed1.layers.values():
        for factor in (layer.down, layer.up):
            assert start <= factor.data_ptr() < end and (factor.data_ptr() - start) % 16 == 0
    engine.swapper.apply([])
    assert_bitwise_equal(base, engine.components)
    engine.swapper.apply([(packed1, 0.7), (packed2, 0.4)])
    assert_bitwise_equal(unpacked, engine.components)
    # applying the same thing again changes nothing: it starts from the pristine copies
    engine.swapper.apply([(packed1, 0.7), (packed2, 0.4)])
    assert_bitwise_equal(unpacked, engine.components)


def test_pristine_copies_cover_exactly_the_touched_weights(adapter_factory, tmp_path):
    adapter_factory("attn", "tiny-sd", rank=8, targets="attn", seed=82, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    bound = engine.adapters.read(AdapterRef("attn"))
    before = weights_snapshot(engine.components)
    engine.set_adapters([("attn", 1.0)])
    after = weights_snapshot(engine.components)
    touched = {f"{component}.{param}" for component, param in bound.layers}
    assert {k for k in before if not torch.equal(before[k], after[k])} == touched
    assert engine.swapper.pristine_bytes == sum(before[k].nbytes for k in touched)
    engine.set_adapters([])
    assert_bitwise_equal(before, engine.components)


def test_adapter_replaced_on_disk_is_served_with_its_new_content(adapter_factory, tmp_path):
    import os

    import numpy as np

    from loraswap.engine.request import GenerateRequest

    path = adapter_factory("changing", "tiny-sd", rank=8, targets="all", alpha=16.0, seed=83, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    request = GenerateRequest(prompt="x", seed=3, steps=2, loras=[("changing", 1.0)])
    old = np.asarray(engine.generate(request).image)
    adapter_factory("changing", "tiny-sd", rank=8, targets="all", alpha=16.0, seed=84, folder=tmp_path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new mtime even on coarse clocks
    new = np.asarray(engine.generate(request).image)
    fresh = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, compile=False, warmup=False))
    assert np.array_equal(new, np.asarray(fresh.generate(request).image))
    assert not np.array_equal(new, old)
    assert engine.adapters.cache.misses == 2


def test_packing_writes_every_element_of_its_buffer(adapter_factory, tmp_path, monkeypatch):
    """The buffer is allocated uninitialized and written once: factors copied in, the
    alignment padding between them zeroed, so the NaN check over the whole buffer never
    sees stale memory. Here fresh buffers come pre-filled with NaN to prove it (bytes of 0xFF
    where a buffer is allocated as bytes: NaN in float16, bfloat16 and float32 alike)."""
    from loraswap.engine.swap import fused as swap

    adapter_factory("odd", "tiny-sdxl", rank=3, targets="all", text_encoder=True, seed=82, folder=tmp_path)
    engine = Engine(EngineConfig(model="tiny-sdxl", adapters=tmp_path, compile=False, warmup=False))
    real_empty = torch.empty
    def stale(*a, **kw):
        fresh = real_empty(*a, **kw)
        return fresh.fill_(float("nan") if fresh.is_floating_point() else 0xFF)

    monkeypatch.setattr(swap.torch, "empty", stale)
    bound = engine.adapters.read(AdapterRef("odd"))  # bound (and checked for NaN) under the NaN-filling allocator
    factors = sum(layer.down.numel() + layer.up.numel() for layer in bound.layers.values())
    assert bound.packed.numel() > factors  # rank 3: there is padding
    assert torch.isfinite(bound.packed).all()
    assert int((bound.packed == 0).sum()) >= bound.packed.numel() - factors


def test_host_pristine_copies_are_all_made_at_start_up(adapter_factory, tmp_path):
    """`--pristine host` copies every weight an adapter may touch at start-up (pinning host
    RAM inside a request's swap took seconds on the H200); swaps then add none and give the
    same weights as lazily made device copies."""
    adapter_factory("h1", "tiny-flux", rank=8, targets="all", alpha=32.0, seed=83, folder=tmp_path)
    common = dict(model="tiny-flux", adapters=tmp_path, compile=False, warmup=False)
    host, device = (Engine(EngineConfig(**common, pristine=where)) for where in ("host", "device"))
    matrices = {k for k, p in host.swapper.layers.params.items() if p.ndim >= 2 and k[0] != "text_encoder_2"}
    assert host.swapper.pristine_layers == matrices
    assert device.swapper.pristine_bytes == 0
    made = host.swapper.pristine_bytes
    base = weights_snapshot(host.components)
    for engine in (host, device):
        engine.set_adapters([("h1", 0.8)])
    assert host.swapper.pristine_bytes == made
    assert_bitwise_equal(weights_snapshot(device.components), host.components)
    host.set_adapters([])
    assert_bitwise_equal(base, host.components)
