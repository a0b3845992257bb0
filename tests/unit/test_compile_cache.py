"""The compile cache folder (where torch and Triton look, folders that cannot be used, a
compile that fails with the cache) and the start-up figures in /metrics."""

import logging
import os
import shutil

import numpy as np
import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from prometheus_client.parser import text_string_to_metric_families

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.engine.startup.compile import use_compile_cache
from loraswap.server.metrics import EngineFigures, Metrics

ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def restore_caches(monkeypatch):
    """Put torch's cache settings of this process back after the test."""
    for key in ENV:
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)
    inductor, functorch = torch._inductor.config, torch._functorch.config
    with inductor.patch(fx_graph_cache=inductor.fx_graph_cache), \
            functorch.patch(enable_autograd_cache=functorch.enable_autograd_cache):
        yield


def test_torch_and_triton_look_in_the_folder_when_they_compile(tmp_path, restore_caches):
    from torch._inductor.runtime.runtime_utils import cache_dir

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    folder = use_compile_cache(tmp_path / "new" / "cache")
    assert folder == tmp_path / "new" / "cache"
    assert (folder / "inductor").is_dir() and (folder / "triton").is_dir()
    # read now, long after import: the folder applies to everything compiled from here on
    assert cache_dir() == str(folder / "inductor")
    assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
    triton = pytest.importorskip("triton")
    assert triton.knobs.cache.dir == str(folder / "triton")


def test_a_folder_that_cannot_be_made_is_skipped_with_a_warning(tmp_path, restore_caches, caplog):
    before = {key: os.environ.get(key) for key in ENV}
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="loraswap"):
        assert use_compile_cache(tmp_path / "a-file" / "cache") is None
    assert "cannot be used" in caplog.text and "a-file" in caplog.text
    assert {key: os.environ.get(key) for key in ENV} == before


def test_engine_with_an_unusable_folder_starts_and_records_its_startup(tmp_path, restore_caches, caplog):
    (tmp_path / "a-file").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="loraswap"):
        engine = Engine(EngineConfig(model="tiny-sd", compile=False, compile_cache=tmp_path / "a-file" / "cache"))
    assert engine.compile_cache is None and "cannot be used" in caplog.text
    assert set(engine.startup_seconds) == {"load_s", "warmup_s", "first_image_s"}
    assert 0 < engine.startup_seconds["load_s"] < engine.startup_seconds["first_image_s"]
    assert engine.compile_cache_lookups == {cache: {"hit": 0, "miss": 0, "bypass": 0}
                                            for cache in ("fxgraph", "aotautograd")}


def test_a_first_image_failing_with_the_cache_is_made_again_in_a_fresh_folder(tmp_path, restore_caches, caplog):
    given = tmp_path / "cache"
    engine = Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False, compile_cache=given))
    assert engine.compile_cache == given and "first_image_s" not in engine.startup_seconds
    real, calls = engine.pipeline, []

    def breaks_once_per_test(**kwargs):  # as a cache whose compiled kernels do not load would
        calls.append(kwargs)
        if len(calls) in (1, 3):
            torch.randn(4, generator=kwargs["generator"][0])  # the latents drawn before the failure
            raise RuntimeError("C++ compile error")
        return real(**kwargs)

    engine.pipeline = breaks_once_per_test
    request = GenerateRequest(prompt="x", seed=0, steps=2)
    try:
        with caplog.at_level(logging.WARNING, logger="loraswap"):
            result = engine.generate(request)
        assert len(calls) == 2 and result.image.size == (64, 64)
        assert engine.compile_cache != given and engine.compile_cache.is_dir()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(engine.compile_cache / "inductor")
        assert f"Delete {given}" in caplog.text and "RuntimeError: C++ compile error" in caplog.text
        assert given.is_dir(), "the folder given is left as it is"
        assert "first_image_s" in engine.startup_seconds
        # after the first image a failure is the request's own: raised, not retried
        with pytest.raises(RuntimeError, match="C\\+\\+ compile error"):
            engine.generate(request)
        assert len(calls) == 3
        engine.pipeline = real  # the retried image is the seed's, not one from the failed call's generator
        assert np.array_equal(np.asarray(engine.generate(request).image), np.asarray(result.image))
    finally:
        shutil.rmtree(engine.compile_cache, ignore_errors=True)


def _samples(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_startup_figures_of_replicas_merge_into_metrics():
    def replica(load, first, hits, misses):
        return EngineFigures(ready=True, startup={"m": {"load_s": load, "warmup_s": first - load,
                                                        "first_image_s": first}},
                             compile_cache={"m": {"fxgraph": {"hit": hits, "miss": misses, "bypass": 0}}})

    total = EngineFigures()
    total.add(replica(10.0, 14.0, 2, 0))
    total.add(replica(12.0, 13.0, 0, 2))
    total.add(replica(99.0, 999.0, 5, 5), gauges=False)  # a replica gone: not counted
    total.replicas = [{"model": "m", "replica": "r1", "alive": True, "loads": 0, "evictions": 0, "held": [],
                       "served": 0, "figures": replica(10.0, 14.0, 2, 0)}]
    text = Metrics().render(total).decode()
    seconds = _samples(text, "loraswap_startup_seconds")
    assert seconds == {(("model", "m"), ("phase", "load")): 12.0, (("model", "m"), ("phase", "warmup")): 4.0,
                       (("model", "m"), ("phase", "first_image")): 14.0}, "the slowest replica's"
    lookups = _samples(text, "loraswap_compile_cache_lookups")
    assert lookups[(("cache", "fxgraph"), ("model", "m"), ("result", "hit"))] == 2
    assert lookups[(("cache", "fxgraph"), ("model", "m"), ("result", "miss"))] == 2
    per_replica = _samples(text, "loraswap_replica_startup_seconds")
    assert per_replica[(("model", "m"), ("phase", "first_image"), ("replica", "r1"))] == 14.0
