"""The hooks loraswap adds around diffusers' cache hooks, in diffusers' own hook registry
(`diffusers.hooks.HookRegistry`), so that they come off with the cache:

- `PassNames`, on the denoiser: names each pass of a step ("cond", then "uncond") for the
  cache's per-pass state, whether or not the pipeline names them (FLUX.1 does; FLUX.1
  Kontext, FLUX.2, Z-Image and SD 3 do not), and counts the passes;
- `Computed`, on the last block, innermost: counts the passes whose blocks really ran
  (a skipped pass never reaches it), and with `record_ratios` measures MagCache's ratio of
  residual magnitudes per step (the last block's output against the first block's input).
"""

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import CacheContext, _set_cache_context

PASS_NAMES = "loraswap_step_cache_passes"
COMPUTED = "loraswap_step_cache_computed"
FIRST_INPUT = "loraswap_step_cache_first_input"
NAMES = ("cond", "uncond")


class PassNames(ModelHook):
    """Sets the cache's context for each pass of the denoiser by its place in the step (the
    step's end is told by `step_ended`, from the pipeline's step callback)."""

    def __init__(self, denoiser: torch.nn.Module):
        super().__init__()
        self.denoiser = denoiser
        self.in_step = 0
        self.passes = 0

    def pre_forward(self, module, *args, **kwargs):
        name = NAMES[self.in_step] if self.in_step < len(NAMES) else f"pass{self.in_step}"
        _set_cache_context(self.denoiser, CacheContext(name))
        self.in_step += 1
        self.passes += 1
        return args, kwargs

    def step_ended(self) -> None:
        self.in_step = 0


class FirstInput(ModelHook):
    """Keeps the first block's hidden states as it receives them (MagCache's calibration)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.metadata = TransformerBlockRegistry.get(type(block))
        self.hidden_states: torch.Tensor | None = None

    def pre_forward(self, module, *args, **kwargs):
        self.hidden_states = self.metadata._get_parameter_from_args_kwargs(
            self.metadata.hidden_states_argument_name, args, kwargs)
        return args, kwargs


class Computed(ModelHook):
    """Counts the passes that ran the last block; with `first` given, also records per step
    of the first pass the mean over tokens of |residual now| / |residual before|, MagCache's
    calibration (the first step's ratio is 1)."""

    def __init__(self, block: torch.nn.Module, first: FirstInput | None = None, passes: PassNames | None = None):
        super().__init__()
        self.metadata = TransformerBlockRegistry.get(type(block))
        self.first = first
        self.passes = passes
        self.computed = 0
        self.ratios: list[float] = []
        self._previous: torch.Tensor | None = None

    def post_forward(self, module, output):
        self.computed += 1
        first_pass = self.passes is None or self.passes.in_step == 1  # calibrated on the conditioned pass
        if self.first is not None and self.first.hidden_states is not None and first_pass:
            self._record(output)
        return output

    def _record(self, output) -> None:
        hidden = output[self.metadata.return_hidden_states_index] if isinstance(output, tuple) else output
        start = self.first.hidden_states
        residual = (hidden[:, -start.shape[1]:] - start).float()  # the image tokens sit at the end
        norms = torch.linalg.vector_norm(residual, dim=-1)
        if self._previous is None:
            self.ratios.append(1.0)
        else:
            self.ratios.append((norms / (self._previous + 1e-8)).mean().item())
        self._previous = norms


def register_first(module: torch.nn.Module, hook: ModelHook, name: str) -> None:
    """`hook` on `module` before any other hook is there: innermost, right around the forward."""
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


def remove(module: torch.nn.Module, name: str) -> None:
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        registry.remove_hook(name, recurse=False)
        registry.invalidate_child_registries_cache()
