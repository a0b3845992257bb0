"""Step caching for one served model, beside the engine: diffusers' cache hooks put on the
denoiser for one pipeline call and taken off after it.

A cache's state (the residuals it reuses, the Taylor factors, the accumulated error) is the
call's alone: the hooks are made fresh for each call and removed when it ends, however it
ends, so nothing of one request's adapters or prompt reaches the next, and a call without a
cache runs the model exactly as it runs without this module. The hooks sit outside the
compiled blocks (`compile.compile_denoiser` compiles each block's forward), so caching on,
off or by another method never compiles anything new.

With context parallelism each process holds a slice of the sequence, so First-Block Cache's
measure (a mean over the sequence) is summed over every process before it decides: all skip
the same steps. TaylorSeer's and MagCache's decisions follow from the step alone.
"""

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers.hooks import (
    FirstBlockCacheConfig,
    HookRegistry,
    MagCacheConfig,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
    apply_mag_cache,
    apply_taylorseer_cache,
)
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
from diffusers.hooks.hooks import _set_cache_context
from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

from loraswap.engine.step_cache.hooks import (
    COMPUTED,
    FIRST_INPUT,
    PASS_NAMES,
    Computed,
    FirstInput,
    PassNames,
    register_first,
    remove,
)
from loraswap.engine.step_cache.settings import METHODS, StepCacheSetting, parse_step_cache
from loraswap.errors import BadRequest, UnsupportedInput

# diffusers' own functions, as `CacheMixin.enable_cache` calls them: applied directly, they also
# serve the transformers that do not mix `CacheMixin` in (SD 3's, Z-Image's)
APPLY = {"first-block": apply_first_block_cache, "taylorseer": apply_taylorseer_cache, "magcache": apply_mag_cache}
HOOKS = (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK,
         _TAYLORSEER_CACHE_HOOK)


@dataclass
class Skips:
    """What a call's cache computed and skipped, counted by its hooks."""

    setting: StepCacheSetting | None  # None: MagCache's ratios measured, nothing cached
    steps: int = 0  # steps ended (the pipeline's step callback)
    passes: list[PassNames] = field(default_factory=list)
    computed: list[Computed] = field(default_factory=list)

    def restart(self) -> None:
        """Counted afresh (a call retried)."""
        self.steps = 0
        self.passes.clear()
        self.computed.clear()

    def step_ended(self) -> None:
        self.steps += 1
        for names in self.passes:
            names.step_ended()

    def chain(self, on_step: Callable[[int, int], None] | None) -> Callable[[int, int], None]:
        """The pipeline's step callback: the step's end told to the hooks, then `on_step`."""
        def step_ended(done: int, total: int) -> None:
            self.step_ended()
            if on_step is not None:
                on_step(done, total)
        return step_ended

    @property
    def steps_skipped(self) -> int:
        """Steps whose blocks did not run (passes skipped over passes per step, rounded)."""
        passes = sum(names.passes for names in self.passes)
        skipped = passes - sum(hook.computed for hook in self.computed)
        return round(skipped * self.steps / passes) if passes else 0


def transformer_families() -> list[str]:
    """The families whose denoiser is a transformer (those that take a step cache; FLUX.2
    takes taylorseer and magcache)."""
    from loraswap.models.families import FAMILIES

    names = [f.name for f in FAMILIES if "transformer" in inspect.signature(f.pipeline_class.__init__).parameters]
    return list(dict.fromkeys(names))


def block_lists(denoiser: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The denoiser's lists of transformer blocks, in order (the lists diffusers' caches walk)."""
    return [(name, child) for name, child in denoiser.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList) and len(child)]


def takes_step_cache(denoiser: torch.nn.Module) -> bool:
    """A transformer whose every block diffusers' cache hooks know."""
    if not block_lists(denoiser):
        return False
    try:
        for _, blocks in block_lists(denoiser):
            _name_hidden_states(type(blocks[0]))
    except ValueError:
        return False
    return True


def _name_hidden_states(block_class: type) -> None:
    """diffusers' record of a block class, its hidden states' argument named as the block's
    forward names it (diffusers 0.42.1 registers Z-Image's block as taking `hidden_states`,
    where its forward takes `x`: every cache hook on it would fail to find its input)."""
    metadata = TransformerBlockRegistry.get(block_class)
    arguments = list(inspect.signature(block_class.forward).parameters)[1:]
    if metadata.hidden_states_argument_name not in arguments:
        metadata.hidden_states_argument_name = arguments[0]
        metadata._cached_parameter_indices = None


def _returns_every_stream(denoiser: torch.nn.Module) -> bool:
    """Whether every block returns each stream it takes: SD 3's last block returns no text
    stream (`context_pre_only`), which TaylorSeer cannot record and First-Block Cache cannot
    subtract."""
    return not any(getattr(block, "context_pre_only", False) for _, blocks in block_lists(denoiser) for block in blocks)


class StepCache:
    """The step caches one model serves: its default, the methods requests may choose, and
    MagCache's ratios (`calibration.py`)."""

    def __init__(self, denoisers: Sequence[torch.nn.Module], model_name: str, default: str | None,
                 allow: Sequence[str], world: int = 1, whole_graph: bool = False):
        self.denoisers = list(denoisers)
        self.model_name = model_name
        self.allow = tuple(allow)
        self.world = world
        self.ratios: list[float] | None = None  # MagCache's, for the model's default steps
        self.takes = all(takes_step_cache(d) for d in self.denoisers)
        # the methods this model's blocks cannot take, and why (diffusers' hooks' limits), read once
        self.refusals = _refusals(self.denoisers, whole_graph) if self.takes else {}
        self.default = parse_step_cache(default) if default else None
        if self.default is not None:
            self._check_takes(self.default)

    def choose(self, asked: str | None) -> StepCacheSetting | None:
        """The setting a request gets: its own (`off`, or a method the server allows), else the
        server's default. BadRequest / UnsupportedInput naming what would be accepted."""
        if asked is None:
            return self.default
        setting = parse_step_cache(asked)
        if setting is not None:
            if setting.method not in self.allow and setting.method != getattr(self.default, "method", None):
                allowed = ", ".join(("off",) + self.allow)
                raise BadRequest(f"this server serves the step caches {allowed}, not {setting.method}")
            self._check_takes(setting)
        return setting

    def capabilities(self) -> dict:
        """What a client may ask of this model: the step caches it takes and the server allows
        (`step_caches`), and the server's default (`step_cache`)."""
        allowed = set(self.allow) | ({self.default.method} if self.default else set())
        takes = [m for m in METHODS if self.takes and m in allowed and m not in self.refusals]
        return {"step_caches": takes, "step_cache": str(self.default) if self.default else "off"}

    def resolved(self, request):
        """`request` with the step cache it runs with (its own, else the server's default), checked
        by `choose`: the worker batches by it (`Job.batch_key`), so a default is filled in."""
        setting = self.choose(request.step_cache)
        return request.model_copy(update={"step_cache": str(setting) if setting is not None else "off"})

    def _check_takes(self, setting: StepCacheSetting) -> None:
        if not self.takes:
            raise UnsupportedInput(f"{self.model_name} takes no step cache: step caching serves the transformer "
                                   f"families ({', '.join(transformer_families())}); ask for step_cache off")
        reason = self.refusals.get(setting.method)
        if reason is not None:
            takes = [method for method in METHODS if method not in self.refusals] or ["off"]
            raise UnsupportedInput(f"{self.model_name} cannot take {setting.method}: {reason}; it takes "
                                   f"{', '.join(takes)}")
        if setting.method == "magcache" and self.ratios is None and setting is not self.default:
            raise BadRequest(f"{self.model_name} has no MagCache calibration: the operator names magcache in "
                             "--step-cache or --step-cache-allow to calibrate it at start-up")

    @contextlib.contextmanager
    def attached(self, setting: StepCacheSetting, steps: int, skips: Skips,
                 record_ratios: bool = False) -> Iterator[Skips]:
        """The cache on every denoiser for one call, counted in `skips`; taken off after it."""
        try:
            for denoiser in self.denoisers:
                self._attach(denoiser, setting, steps, skips, record_ratios)
            yield skips
        finally:
            for denoiser in self.denoisers:
                _detach(denoiser)

    def _attach(self, denoiser: torch.nn.Module, setting: StepCacheSetting, steps: int, skips: Skips,
                record_ratios: bool) -> None:
        lists = block_lists(denoiser)
        first, last = lists[0][1][0], lists[-1][1][-1]
        names = PassNames(denoiser)
        starts = FirstInput(first) if record_ratios else None
        computed = Computed(last, starts, names)
        register_first(last, computed, COMPUTED)  # innermost: before the cache wraps the block
        if starts is not None:
            register_first(first, starts, FIRST_INPUT)
        if not record_ratios:
            APPLY[setting.method](denoiser, self._config(denoiser, setting, steps))
            HookRegistry.check_if_exists_or_initialize(denoiser).invalidate_child_registries_cache()
            if setting.method == "first-block" and self.world > 1:
                _decide_together(first)
        register_first(denoiser, names, PASS_NAMES)
        skips.passes.append(names)
        skips.computed.append(computed)

    def _config(self, denoiser: torch.nn.Module, setting: StepCacheSetting, steps: int):
        if setting.method == "first-block":
            return FirstBlockCacheConfig(threshold=setting["threshold"])
        if setting.method == "taylorseer":
            blocks = [rf"{name}\.\d+" for name, _ in block_lists(denoiser)]
            return TaylorSeerCacheConfig(cache_interval=int(setting["interval"]), max_order=int(setting["order"]),
                                         disable_cache_before_step=int(setting["warmup"]),
                                         taylor_factors_dtype=denoiser.dtype, skip_predict_identifiers=blocks,
                                         cache_identifiers=["proj_out"])
        return MagCacheConfig(threshold=setting["threshold"], max_skip_steps=int(setting["max_skip"]),
                              retention_ratio=setting["retention"], num_inference_steps=steps,
                              mag_ratios=torch.tensor(self.ratios))


def _detach(denoiser: torch.nn.Module) -> None:
    """Every hook of the call off the denoiser (the cache's and the counters), its context cleared."""
    remove(denoiser, PASS_NAMES)
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    for name in HOOKS:
        registry.remove_hook(name, recurse=True)
    registry.invalidate_child_registries_cache()
    lists = block_lists(denoiser)
    remove(lists[0][1][0], FIRST_INPUT)
    remove(lists[-1][1][-1], COMPUTED)
    _set_cache_context(denoiser, None)


def _refusals(denoisers: Sequence[torch.nn.Module], whole_graph: bool) -> dict[str, str]:
    """The methods this model's blocks cannot take, and why (diffusers' hooks' limits)."""
    if whole_graph:
        reason = ("this server compiles the whole denoiser (the CUDA-graph modes --compile-mode reduce-overhead "
                  "and max-autotune, or a transformer that names no repeated blocks), where a cache cannot skip "
                  "blocks; serve it with the default compile mode, or --no-compile")
        return dict.fromkeys(METHODS, reason)
    refused = {}
    if not all(_returns_every_stream(d) for d in denoisers):
        reason = "its last block returns no text stream, which the hooks need"
        refused |= {"first-block": reason, "taylorseer": reason}
    if not all(_first_block_fits(d) for d in denoisers):
        refused.setdefault("first-block", "diffusers' First-Block Cache needs blocks that take `hidden_states` "
                                          "and whose first and last return the same streams")
    if not all(hasattr(d, "proj_out") for d in denoisers):
        refused.setdefault("taylorseer", "it has no output projection (proj_out) to predict")
    if len(denoisers) > 1:  # diffusers' MagCache counts steps per denoiser: the second would start at 0
        refused["magcache"] = "MagCache counts the steps of each of its two experts from 0, off its ratios"
    return refused


def _first_block_fits(denoiser: torch.nn.Module) -> bool:
    """Whether the blocks take `hidden_states` by that name (the head hook asks for it, not
    for the block's own name: Z-Image's blocks take `x`) and the first and last return the
    same parts (both the text and image streams, or both one sequence: FLUX.2's single
    blocks return one), as First-Block Cache's residuals need."""
    lists = block_lists(denoiser)
    if "hidden_states" not in inspect.signature(type(lists[0][1][0]).forward).parameters:
        return False
    first, last = (TransformerBlockRegistry.get(type(blocks[i])) for (_, blocks), i in ((lists[0], 0), (lists[-1], -1)))
    return (first.return_encoder_hidden_states_index is None) == (last.return_encoder_hidden_states_index is None)


def _decide_together(first_block: torch.nn.Module) -> None:
    """First-Block Cache's decision from the sums of every process's slice (all-reduced), so
    that every process skips the same steps."""
    hook = first_block._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)

    def should_compute(residual: torch.Tensor) -> bool:
        before = hook.state_manager.get_state().head_block_residual
        if before is None:
            return True
        sums = torch.stack([(residual - before).abs().sum(), before.abs().sum()]).float()
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item() > hook.threshold

    hook._should_compute_remaining_blocks = should_compute
