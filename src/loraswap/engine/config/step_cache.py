"""Which step caches the engine takes: its default, those a request may ask for, MagCache's ratios."""

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraswap.flags import SPEED, Flag


class StepCacheConfig(BaseModel):
    """The step caches (blocks skipped on the steps a cache stands in for) this engine serves."""

    model_config = ConfigDict(extra="forbid")

    step_cache: Annotated[str, Flag(SPEED)] = Field(
        "off", description="Skip the denoiser's blocks on steps a cache can stand in for, by default: off, "
                           "first-block[:threshold=T], taylorseer[:interval=N,order=K,warmup=W] or "
                           "magcache[:threshold=T,max_skip=N,retention=R] (transformer models only; a request's "
                           "step_cache overrides it).")
    step_cache_allow: Annotated[list[str], Flag(SPEED)] = Field(
        default_factory=lambda: ["first-block", "taylorseer"], description="A step cache method requests may "
        "ask for (besides off and --step-cache's); magcache is calibrated on the model at start-up.")
    step_cache_calibration: Annotated[Path | None, Flag(SPEED)] = Field(
        None, description="MagCache's ratios for this model (a JSON list, one per step) instead of measuring them "
                          "at start-up.")

    @field_validator("step_cache")
    @classmethod
    def _known_step_cache(cls, text: str) -> str:
        from loraswap.engine.step_cache import canonical
        from loraswap.errors import BadRequest

        try:
            return canonical(text)
        except BadRequest as e:  # a config's validator raises ValueError
            raise ValueError(str(e)) from None

    @field_validator("step_cache_allow")
    @classmethod
    def _known_methods(cls, methods: list[str]) -> list[str]:
        from loraswap.engine.step_cache import METHODS

        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown step cache {', '.join(unknown)}: use {', '.join(METHODS)}")
        return methods
