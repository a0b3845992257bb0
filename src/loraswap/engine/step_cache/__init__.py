"""Step caching: skipping the denoiser's blocks on steps whose result a cache can stand in
for (`settings`: what a setting is; `attach`: the hooks on the model for one call;
`calibration`: MagCache's ratios; `for_engine`: `StepCaching`, what the engine holds of it)."""

from loraswap.engine.step_cache.attach import Skips, StepCache, takes_step_cache, transformer_families
from loraswap.engine.step_cache.calibration import PROMPT, read_ratios, shared
from loraswap.engine.step_cache.for_engine import StepCaching
from loraswap.engine.step_cache.settings import METHODS, OFF, StepCacheSetting, canonical, parse_step_cache

__all__ = ["METHODS", "OFF", "PROMPT", "Skips", "StepCache", "StepCacheSetting", "StepCaching", "canonical",
           "parse_step_cache", "read_ratios", "shared", "takes_step_cache", "transformer_families"]
