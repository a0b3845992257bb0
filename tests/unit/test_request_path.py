"""The request path's own costs: images made 8-bit on the device, adapters read into pageable
RAM and pinned afterwards, the VAE decoder compiled with the denoiser."""

import gc
import logging
import threading
import weakref

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from support.adapters import adapter

from loraswap.adapters.bound import BoundAdapter
from loraswap.adapters.cache import AdapterCache, CacheConfig
from loraswap.adapters.reference import AdapterRef, as_refs
from loraswap.engine.calls import to_pil
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_pil_gives_diffusers_pixels_bitwise(dtype):
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 16, 24, generator=generator)
    # ties: x * 255 lands exactly on .5 (rounded to even), and the ends of the range
    images[0, 0, 0, :8] = torch.tensor([0.5, 1.5, 2.5, 253.5, 254.5, 0.0, 255.0, 127.5]) / 255
    images = images.to(dtype)
    ours = to_pil(images)
    theirs = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images))
    assert len(ours) == 3
    for a, b in zip(ours, theirs):
        assert a.mode == b.mode == "RGB" and a.size == b.size == (24, 16)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    gray = to_pil(images[:, :1])
    assert gray[0].mode == "L" and np.array_equal(np.asarray(gray[0]), np.asarray(
        VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images[:1, :1]))[0]))


def test_engine_image_equals_the_pipelines_own_pil_image(adapter_factory):
    adapter_factory("path-a", "tiny-sd", rank=8, seed=3)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    request = GenerateRequest(prompt="a red bicycle", seed=11, steps=2, width=64, height=64,
                              loras=[("path-a", 1.0)])
    assert engine.calls.images_on_device("text"), "tiny-sd postprocesses with VaeImageProcessor: images made by to_pil"
    ours = engine.generate(request).image
    theirs = engine.pipeline("a red bicycle", generator=torch.Generator("cpu").manual_seed(11),
                             num_inference_steps=2, width=64, height=64).images[0]
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def _fake_pinning(monkeypatch, calls: list, fail: bool = False, gate: threading.Event | None = None):
    """CPU torch cannot pin: `Tensor.pin_memory` becomes a copy (or an error), recorded; with
    `gate`, each pin first waits for it (a pinner kept busy)."""
    def pin_memory(self):
        if gate is not None:
            assert gate.wait(30)
        calls.append(self.nbytes)
        if fail:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return self.clone()
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


def test_fresh_reads_are_pageable_then_pinned_off_the_request_path(adapter_factory, monkeypatch):
    adapter_factory("path-b", "tiny-sd", rank=16, targets="all", seed=5)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    engine.adapters.cache.pin_host = True  # as on CUDA
    calls, gate = [], threading.Event()
    _fake_pinning(monkeypatch, calls, gate=gate)  # the pinner busy: the read must not wait for it
    lease = engine.adapters.lease_now(as_refs([("path-b", 1.0)]))
    entry = lease.held[0][0]
    read = entry.host
    assert calls == [] and entry.host is read, "the read returned before any pinning"
    gate.set()
    engine.adapters.cache.finish_pinning()  # the pin job ran after the read
    assert calls == [read.packed.nbytes], "the packed buffer was pinned once, after the read"
    assert entry.host is not read and torch.equal(entry.host.packed, read.packed)
    assert all(torch.equal(entry.host.layers[k].down, read.layers[k].down) for k in read.layers)

    swapped = engine.apply(lease)
    lease.release()
    assert swapped > 0
    # the same entry, pinned since: no second swap; and a cached lookup pins nothing again
    assert engine.set_adapters([("path-b", 1.0)]) == 0.0
    engine.adapters.cache.finish_pinning()
    assert len(calls) == 1


def test_a_failed_pin_leaves_the_pageable_copy_serving(adapter_factory, monkeypatch, caplog):
    adapter_factory("path-c", "tiny-sd", rank=4, seed=6)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    engine.adapters.cache.pin_host = True
    calls = []
    _fake_pinning(monkeypatch, calls, fail=True)
    with caplog.at_level(logging.WARNING, logger="loraswap.adapters.cache"):
        with engine.adapters.lease_now(as_refs([("path-c", 1.0)])) as lease:
            entry = lease.held[0][0]
            read = entry.host
        engine.adapters.cache.finish_pinning()
    assert calls and entry.host is read
    assert "could not pin adapter path-c" in caplog.text
    assert engine.set_adapters([("path-c", 1.0)]) > 0


def test_replace_host_only_for_the_cached_entry_and_the_same_bytes():
    cache = AdapterCache(CacheConfig(host_bytes=8 * 2**20, gpu_bytes=0), torch.device("cpu"))
    entry = cache.insert("a", adapter("a", 2), (1,))
    cache.release(entry)
    with pytest.raises(ValueError, match="not the same factors"):
        cache.replace_host(entry, adapter("a", 1))
    copy = BoundAdapter("a", entry.host.layers).to("cpu")
    assert cache.replace_host(entry, copy) and entry.host is copy
    cache.evict("a")  # evicted: a late pin changes nothing
    assert not cache.holds(entry)
    assert not cache.replace_host(entry, BoundAdapter("a", entry.host.layers).to("cpu"))
    assert entry.host is copy


@pytest.mark.parametrize("mode,compile_mode,compile_vae,compiled", [
    ("fused", "default", None, False),  # regional compile (FLUX.1): a restart 3 s sooner matters more
    ("fused", "reduce-overhead", None, True),  # CUDA graphs (SDXL, SD 1.5): the decode is a twentieth of a request
    ("fused", "default", True, True),
    ("fused", "reduce-overhead", False, False),
    ("load-and-fuse", "default", True, False),  # the load-and-fuse baseline runs eager
])
def test_vae_decoder_compiled_with_the_denoiser(mode, compile_mode, compile_vae, compiled):
    # (compile is lazy: nothing is traced before a forward, so this stays fast on CPU)
    engine = Engine(EngineConfig(model="tiny-sd", compile=True, compile_mode=compile_mode, compile_vae=compile_vae,
                                 swap_mode=mode, warmup=False))
    assert (engine.pipeline.vae.decoder._compiled_call_impl is not None) is compiled
    # regional compile compiles each repeated block's forward (`compile.compile_blocks`), the CUDA-graph modes the call
    unet_compiled = any(m._compiled_call_impl is not None
                        or hasattr(vars(m).get("forward"), "_torchdynamo_orig_callable")
                        for m in engine.pipeline.unet.modules())
    assert unet_compiled is (mode == "fused")


def test_an_entry_evicted_before_its_pin_is_neither_pinned_nor_kept(adapter_factory, monkeypatch):
    adapter_factory("path-d", "tiny-sd", rank=8, seed=7)
    adapter_factory("path-d-first", "tiny-sd", rank=2, seed=8)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    engine.adapters.cache.pin_host = True
    calls, gate = [], threading.Event()
    _fake_pinning(monkeypatch, calls, gate=gate)
    with engine.adapters.lease_now(as_refs([("path-d-first", 1.0)])) as first:  # its pin holds the pinner at the gate
        first_bytes = first.held[0][0].host.packed.nbytes
    with engine.adapters.lease_now(as_refs([("path-d", 1.0)])) as lease:
        entry = lease.held[0][0]
    del lease
    engine.adapters.evict(AdapterRef("path-d"))  # evicted while its pin job waits
    gone = weakref.ref(entry)
    del entry
    gc.collect()
    assert gone() is None, "the queued pin job does not keep the evicted entry (and its buffer) alive"
    gate.set()
    engine.adapters.cache.finish_pinning()
    assert calls == [first_bytes], "only the adapter still cached was pinned"
