"""The engine's config, one typed config per concern composed: a setting given flat (as code,
flags and deploy files name it) lands in its concern, nested and flat merge, and nothing
else is taken."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from loraswap.adapters.cache import CacheConfig
from loraswap.cli.settings import SETTINGS
from loraswap.engine.config.compilation import CompilationConfig
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.memory import MemoryConfig
from loraswap.engine.config.parallelism import ParallelConfig, Parallelism
from loraswap.engine.config.quantization import QuantizationConfig
from loraswap.engine.config.sources import SourcesConfig
from loraswap.engine.config.step_cache import StepCacheConfig
from loraswap.engine.config.swap import SwapConfig


def test_flat_keys_land_in_their_concern():
    flat = EngineConfig(model="demo", adapters="folder", max_rank=64, ulysses_degree=2, compile=False,
                        quantize="fp8", pristine="host", step_cache="first-block", max_adapter_mb=3)
    nested = EngineConfig(model="demo", sources=SourcesConfig(adapters=Path("folder"), max_adapter_mb=3),
                          swap=SwapConfig(max_rank=64), parallel=ParallelConfig(ulysses_degree=2),
                          compilation=CompilationConfig(compile=False), quantization=QuantizationConfig(quantize="fp8"),
                          memory=MemoryConfig(pristine="host"), step_caching=StepCacheConfig(step_cache="first-block"))
    assert flat == nested
    assert flat.sources.adapters == Path("folder") and flat.sources.max_adapter_bytes == 3 * 2**20
    assert flat.parallel.parallelism == Parallelism(ulysses=2)
    assert flat.step_caching.step_cache == "first-block:threshold=0.08"


def test_flat_and_nested_merge_and_the_flat_key_wins():
    config = EngineConfig(parallel={"ring_degree": 1, "ulysses_degree": 4}, ulysses_degree=2,
                          swap=SwapConfig(max_blend=2), max_rank=8)
    assert (config.parallel.ulysses_degree, config.parallel.ring_degree) == (2, 1)
    assert (config.swap.max_blend, config.swap.max_rank) == (2, 8)


def test_unknown_keys_are_refused_flat_or_nested():
    with pytest.raises(ValidationError, match="max_ranks"):
        EngineConfig(max_ranks=3)
    with pytest.raises(ValidationError, match="max_ranks"):
        EngineConfig(swap={"max_ranks": 3})
    with pytest.raises(ValidationError, match="host_bytes"):  # the cache's fields were never flat
        EngineConfig(host_bytes=2**20)


def test_checks_across_concerns_and_within_one_still_refuse():
    with pytest.raises(ValidationError, match="--ring-degree needs an attention backend"):
        EngineConfig(ring_degree=2)
    assert EngineConfig(ring_degree=2, attention="_native_cudnn").parallel.parallelism.world == 2
    with pytest.raises(ValidationError, match="exceeds the host budget"):
        EngineConfig(cache=CacheConfig(host_bytes=1, gpu_bytes=2))


def test_a_config_travels_as_json_to_a_rank_or_replica_and_comes_back_equal():
    config = EngineConfig(model="demo", adapters="folder", hub=True, cfg_parallel=True, compile_cache="cache",
                          source=object())
    sent = config.model_dump(mode="json")
    assert "source" not in sent["sources"]  # an object handed in by code stays in its process
    assert EngineConfig.model_validate(sent) == config.model_copy(update={"sources": config.sources.model_copy(
        update={"source": None})})


def test_every_concern_field_is_one_setting_targeted_at_its_concern():
    targets = {s.target for s in SETTINGS if s.target}
    for concern in ("sources", "swap", "parallel", "compilation", "quantization", "memory", "step_caching"):
        fields = type(getattr(EngineConfig(), concern)).model_fields
        assert {f"engines.{concern}.{name}" for name in fields} - {"engines.sources.source"} <= targets, concern
