"""Step caching as the engine holds it: one `StepCaching` per served model, which the engine
calls at its attachment points and never looks inside.

It owns the model's `StepCache` (`attach.py`), MagCache's calibration (the operator's file,
or measured over one image through the engine's `generate`), the setting each request gets
(its `Skips`), the cache put on the model for each attempt of a call, and what a result and
the model's capabilities say of it. With step caching off each of these does nothing, so the
engine reads the same either way.
"""

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_cache.attach import Skips, StepCache
from loraswap.engine.step_cache.calibration import PROMPT, read_ratios, shared
from loraswap.engine.step_cache.settings import StepCacheSetting

logger = logging.getLogger(__name__)


class StepCaching:
    """The step caches one engine serves (`--step-cache`, `--step-cache-allow`,
    `--step-cache-calibration`), from start-up to each call."""

    def __init__(self, denoisers: Sequence[torch.nn.Module], model_name: str, device: torch.device,
                 default: str | None, allow: Sequence[str], calibration: Path | None = None,
                 whole_graph: bool = False):
        self.cache = StepCache(denoisers, model_name, default, allow, whole_graph=whole_graph)
        self.model_name = model_name
        self.device = device
        self.calibration = calibration  # the operator's file of MagCache's ratios (None: measured)
        self._recording: Skips | None = None  # set while MagCache's ratios are measured

    # ---------------------------------------------------------------- the model's
    @property
    def ratios(self) -> list[float] | None:
        """MagCache's ratios for the model's default steps (None: not calibrated)."""
        return self.cache.ratios

    @ratios.setter
    def ratios(self, ratios: list[float] | None) -> None:
        self.cache.ratios = ratios

    def split_over(self, world: int) -> None:
        """The model split over `world` processes (context parallelism): First-Block Cache then
        decides from the sums over every process's slice, so that all skip the same steps."""
        self.cache.world = world

    def choose(self, asked: str | None) -> StepCacheSetting | None:
        """The setting a request asking for `asked` gets (`StepCache.choose`)."""
        return self.cache.choose(asked)

    def resolved(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with the step cache it runs with filled in (`StepCache.resolved`)."""
        return self.cache.resolved(request)

    def capabilities(self) -> dict:
        """The step caches a client may ask of this model, and the server's default."""
        return self.cache.capabilities()

    # ---------------------------------------------------------------- MagCache's calibration
    def calibrate(self, generate: Callable[[GenerateRequest], object],
                  warm_up: Callable[[], GenerateRequest]) -> None:
        """MagCache's ratios, when the server may serve it and has none yet: read from the
        operator's file, or measured now with `generate` over the image of `warm_up()` (the
        warm-up's last request: an edit model's has the image it needs; made only when measured)
        at the model's default steps, of the base model. With several processes every one uses
        the first's."""
        cache = self.cache
        wanted = "magcache" in cache.allow or getattr(cache.default, "method", None) == "magcache" \
            or self.calibration is not None
        if not wanted or not cache.takes or "magcache" in cache.refusals or cache.ratios is not None:
            return
        if self.calibration is not None:
            ratios = read_ratios(self.calibration)
        else:
            ratios = self.measure_ratios(generate, warm_up().model_copy(update={"prompt": PROMPT, "steps": None}))
        cache.ratios = shared(ratios, self.device)
        logger.info("%s: MagCache ratios over %d steps: %s", self.model_name, len(ratios),
                    {"ratios": [round(r, 5) for r in cache.ratios]})

    def measure_ratios(self, generate: Callable[[GenerateRequest], object], request: GenerateRequest) -> list[float]:
        """MagCache's ratios over the image `generate(request)` makes (its adapters applied),
        every step computed: the calls meanwhile record them (`skips_for`) instead of caching."""
        self._recording = Skips(setting=None)
        try:
            generate(request)
            return list(self._recording.computed[0].ratios)
        finally:
            self._recording = None

    # ---------------------------------------------------------------- one call
    def skips_for(self, request: GenerateRequest) -> Skips | None:
        """What counts a call's skips: for the setting `request` gets (refused here when the
        model or the server cannot take it), or the ratios being measured; None: no step cache."""
        setting = self.cache.choose(request.step_cache)
        return self._recording or (Skips(setting) if setting else None)

    @staticmethod
    def counting(skips: Skips | None, on_step: Callable[[int, int], None] | None):
        """The pipeline's step callback: each step's end told to the cache's hooks, then `on_step`."""
        return skips.chain(on_step) if skips else on_step

    def for_attempt(self, skips: Skips | None, kwargs: dict, parameters: Mapping):
        """The call's step cache on the model for one attempt (fresh each time: a call retried
        cold starts clean), taken off after it; nothing without one. `kwargs` are the call's
        arguments, `parameters` those its pipeline takes (for its default steps)."""
        if skips is None:
            return contextlib.nullcontext()
        skips.restart()
        steps = kwargs.get("num_inference_steps") or parameters["num_inference_steps"].default
        return self.cache.attached(skips.setting, steps, skips, record_ratios=skips is self._recording)

    @staticmethod
    def result_fields(skips: Skips | None) -> dict:
        """What a result says of its step cache: the steps skipped and run, and the setting
        (nothing without one, or while ratios are measured)."""
        if not (skips and skips.setting):
            return {}
        return {"steps_skipped": skips.steps_skipped, "steps_run": skips.steps, "step_cache": str(skips.setting)}
