"""Classifier-free guidance over two halves of the ranks (`--cfg-parallel`).

A guided step runs the denoiser twice, with the prompt and with the negative prompt, and
mixes the two predictions. Here the first half of the ranks makes the first pass while the
second half makes the other, at the same time, and they swap results: each step costs one
pass and one exchange of the prediction.

The second half is called with its prompts swapped (`GuidanceSplit.arguments`), so the pass
its pipeline makes first is the negative one. Each denoiser call is marked by the pipeline
(`cache_context("cond")` / `("uncond")`): at the first, every rank computes its own pass and
the halves gather both predictions; every rank then returns the prompt's prediction for the
first call and the negative one for the second, without computing it. Both halves make the
same calls and mix the same tensors, so their latents stay bitwise equal and the image is
the one a single process makes. A call with guidance off (a scale of 1; for Qwen-Image, no
negative prompt) makes only the first pass: the second half's work is wasted.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch.distributed.device_mesh import DeviceMesh

# families whose pipelines guide with a negative prompt, marking each pass, and what each
# one's pipeline does when given none: Wan guides with a blank one; Qwen-Image does not guide
GUIDED = {"wan": "", "qwen-image": None, "qwen-image-edit": None}


def check_guided(family, model: str) -> None:
    name = family.name if family is not None else None
    if name not in GUIDED:
        raise ValueError(f"{model} ({name or 'no family'}) makes no negative pass to split: --cfg-parallel takes "
                         f"the {', '.join(GUIDED)} families")


class GuidanceSplit:
    """This rank's half of the guidance passes over the mesh's `cfg` dimension."""

    def __init__(self, mesh: DeviceMesh, family, denoisers: list[torch.nn.Module]):
        self.group = mesh["cfg"].get_group()
        self.half = mesh["cfg"].get_local_rank()  # 0: the prompt's pass; 1: the negative prompt's
        self.blank = GUIDED[family.name]
        for denoiser in denoisers:
            _split_passes(denoiser, self)

    def arguments(self, kwargs: dict) -> dict:
        """The pipeline's arguments on this rank: on the second half, prompt and negative
        prompt swapped (a missing negative prompt is the blank one the pipeline would use;
        where the pipeline guides only beside one, the call is left as it is: no half guides)."""
        prompt, negative = kwargs["prompt"], kwargs.get("negative_prompt")
        if self.half == 0 or (negative is None and self.blank is None):
            return kwargs
        if negative is None:
            negative = self.blank if isinstance(prompt, str) else [self.blank] * len(prompt)
        return dict(kwargs, prompt=negative, negative_prompt=prompt)

    @torch.compiler.disable  # a collective: never in a compiled graph (or a CUDA graph)
    def exchange(self, prediction: torch.Tensor) -> list[torch.Tensor]:
        """Both halves' predictions: [the prompt's, the negative prompt's]."""
        both = [torch.empty_like(prediction) for _ in range(2)]
        dist.all_gather(both, prediction.contiguous(), group=self.group)
        return both


def _split_passes(denoiser: torch.nn.Module, split: GuidanceSplit) -> None:
    """Patch `denoiser` (once) to make one pass per step and exchange it (see the module doc).
    Its forward is left out of torch.compile's graph, the model's own forward inside it not."""
    forward, cache_context = denoiser.forward, denoiser.cache_context
    state: dict = {"pass": None, "negative": None}

    @contextlib.contextmanager
    def marked_context(name: str, *args, **kwargs) -> Iterator[None]:
        state["pass"] = name
        if name == "cond":  # a step's first pass: the last step's negative prediction is spent
            state["negative"] = None
        try:
            with cache_context(name, *args, **kwargs):
                yield
        finally:
            state["pass"] = None

    @functools.wraps(forward)
    def one_pass(*args, **kwargs):
        if state["pass"] == "uncond":
            if state["negative"] is None:
                raise RuntimeError("--cfg-parallel: a negative pass came before its prompt's pass")
            negative, state["negative"] = state["negative"], None
            return _with_prediction(kwargs, None, negative)
        if state["pass"] != "cond":
            raise RuntimeError(f"--cfg-parallel: the pipeline called {type(denoiser).__name__} outside a marked "
                               "guidance pass")
        output = forward(*args, **kwargs)
        prompt, state["negative"] = split.exchange(_prediction(output))
        return _with_prediction(kwargs, output, prompt)

    denoiser.forward = torch.compiler.disable(one_pass, recursive=False)
    denoiser.cache_context = marked_context


@torch.compiler.disable
def _prediction(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


@torch.compiler.disable
def _with_prediction(kwargs: dict, output, prediction: torch.Tensor):
    """`output` (or, for a pass not computed, the form the call asked for) holding `prediction`."""
    if output is None:
        return Transformer2DModelOutput(sample=prediction) if kwargs.get("return_dict", True) else (prediction,)
    if isinstance(output, tuple):
        return (prediction, *output[1:])
    output.sample = prediction
    return output
