"""The engine's configuration, one typed class per concern, composed by `EngineConfig`
(`engine.py`); each field marked with a `Flag` is a setting of `loraswap serve`."""

from loraswap.engine.config.compilation import CompilationConfig
from loraswap.engine.config.engine import DTYPES, EngineConfig
from loraswap.engine.config.memory import MemoryConfig
from loraswap.engine.config.parallelism import ParallelConfig, Parallelism
from loraswap.engine.config.quantization import QuantizationConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.engine.config.sources import SourcesConfig
from loraswap.engine.config.step_cache import StepCacheConfig
from loraswap.engine.config.swap import SwapConfig

__all__ = ["DTYPES", "CompilationConfig", "EngineConfig", "MemoryConfig", "ParallelConfig", "Parallelism",
           "QuantizationConfig", "SchedulerConfig", "SourcesConfig", "StepCacheConfig", "SwapConfig"]
