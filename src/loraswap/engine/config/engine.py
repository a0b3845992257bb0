"""The engine's configuration: the model it serves, and one config per concern composed.

Each concern's settings are a small typed class of their own module (`sources.py`,
`swap.py`, `parallelism.py`, ...), and the adapter cache's is `adapters.cache.CacheConfig`;
`EngineConfig` holds one of each. A flat key (`EngineConfig(ulysses_degree=2)`, a deploy
file's `max_rank: 256`) is routed to the concern that holds it, so code and config files
name a setting as its flag does.
"""

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraswap.adapters.cache import CacheConfig
from loraswap.engine.config.compilation import CompilationConfig
from loraswap.engine.config.memory import MemoryConfig
from loraswap.engine.config.parallelism import ParallelConfig, check_ring_attention
from loraswap.engine.config.quantization import QuantizationConfig
from loraswap.engine.config.sources import SourcesConfig
from loraswap.engine.config.step_cache import StepCacheConfig
from loraswap.engine.config.swap import SwapConfig
from loraswap.engine.sizes import parse_size
from loraswap.flags import MODELS, Flag

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# the concerns whose fields may also be given flat, as the flags name them ({concern: its config}),
# and the concern of each such field
CONCERNS: dict[str, type[BaseModel]] = {
    "sources": SourcesConfig, "swap": SwapConfig, "parallel": ParallelConfig, "compilation": CompilationConfig,
    "quantization": QuantizationConfig, "memory": MemoryConfig, "step_caching": StepCacheConfig}
CONCERN_OF = {name: concern for concern, config in CONCERNS.items() for name in config.model_fields}


class EngineConfig(BaseModel):
    """How one base model is served. Fields marked with a `Flag` are settings of `loraswap serve`,
    those of the composed configs too (their order here is their order in --help)."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Flag(MODELS, repeat="Repeat to host several base models: the first is the default.")] = (
        Field("tiny-sd", description="A preset (tiny-sd, tiny-sdxl, tiny-flux, ...), a real architecture with "
              "random weights (flux-dev-random, ...), a hub id or a local diffusers folder."))
    device: Annotated[Literal["auto", "cpu", "cuda"], Flag(MODELS)] = Field(
        "auto", description="auto (CUDA when present), cpu or cuda.")
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], Flag(MODELS)] = Field(
        "auto", description="auto (bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16.")
    warmup: Annotated[bool, Flag(MODELS)] = Field(
        True, description="Generate once at start-up, so that the first request finds the model compiled.")
    max_size: Annotated[str | None, Flag(MODELS)] = Field(
        None, description="The largest image the model makes, WIDTHxHEIGHT (either way round); "
        "a larger size asked is refused (400), a larger input image with no size asked is scaled down to fit "
        "(default: twice the model's native size a side, at least 128x128: the demo's 128x128, SDXL's 2048x2048).")
    sources: SourcesConfig = Field(default_factory=SourcesConfig, description="Where adapters come from.")
    swap: SwapConfig = Field(default_factory=SwapConfig, description="The swapper and what it takes.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Adapter cache budgets (host, GPU).")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Processes per image.")
    compilation: CompilationConfig = Field(default_factory=CompilationConfig, description="Compile, attention.")
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig, description="float8 weights.")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="GPU memory, pristine copies.")
    step_caching: StepCacheConfig = Field(default_factory=StepCacheConfig, description="Step caches served.")

    @model_validator(mode="before")
    @classmethod
    def _route_flat_keys(cls, data):
        """`ulysses_degree=2` -> `parallel={"ulysses_degree": 2}`, merged with what that concern was given."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in [n for n in data if n in CONCERN_OF and n not in cls.model_fields]:
            concern = CONCERN_OF[name]
            given = data.get(concern) or {}
            given = dict(given) if isinstance(given, BaseModel) else given
            if isinstance(given, dict):  # (anything else is refused as that concern's field)
                data[concern] = {**given, name: data.pop(name)}
        return data

    @field_validator("max_size")
    @classmethod
    def _a_size(cls, size: str | None) -> str | None:
        if size is not None:
            parse_size(size)
        return size

    @model_validator(mode="after")
    def _ring_merges_with_the_log_sum_exp(self):
        check_ring_attention(self.parallel.parallelism, self.compilation.attention)
        return self

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
