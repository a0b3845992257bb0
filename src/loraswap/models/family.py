"""What a model family is: one record per family (`Family`) says how to build its tiny
presets and its real architectures, which pipelines share its weights for image inputs,
and what it returns. `families/` holds one module per family; adding a family is one
module there, listed in `families/__init__.py`, and its tests.
"""

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from diffusers import DiffusionPipeline
from transformers import PretrainedConfig

# a component of a real architecture: its class and either the keyword arguments of a
# diffusers model or a transformers config (`cls(config)`)
ComponentSpec = tuple[type[torch.nn.Module], Mapping[str, Any] | PretrainedConfig]


@dataclass(frozen=True)
class Architecture:
    """A real architecture with random weights: same compute and memory as the real model.

    `components`: every module of the pipeline; `extras()`: the rest of the pipeline's
    arguments (scheduler, tokenizers made in code, the optional parts set to None).
    """

    components: Mapping[str, ComponentSpec]
    extras: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One model family, as the server, the CLI and the benchmarks need it.

    - `pipeline`: the diffusers class a preset or an architecture is built as (text to
      image or video; for the edit models, their edit pipeline, which also runs without an
      image).
    - `presets`: tiny preset name -> builder (the caller seeds it; real pipeline classes,
      tiny configs, tokenizers made in code).
    - `architectures`: real architecture name -> `Architecture` (served as `<name>-random`).
    - `image_pipelines`: `img2img` / `inpaint` -> the diffusers class that shares the loaded
      weights (`from_pipe`) to serve an image input; edit models take it in `pipeline`.
    - `image_input`: "none" (text only), "variants" (through `image_pipelines`), "edit"
      (the pipeline's own `image`, optional) or "required" (an edit model that needs one).
    - `output`: "image" or "video" (frames, encoded by the server at `fps`).
    - `defaults`: generation defaults of its tiny presets (real models keep their pipeline's):
      `width`, `height`, `steps`, `frames`, `guidance`.
    - `call_names`: request field -> the pipeline's argument where it differs
      (Qwen-Image's `true_cfg_scale` for the guidance scale).
    - `adjust_call`: the family's own change to a call's keyword arguments, if any (FLUX.1
      Kontext's output area follows the asked size only when told so).
    - `edit_tokens`: for a call with an input image, the tokens of the denoiser's sequence
      (the output's and the input's, which a split over processes must divide), given the
      pixels a token spans (FLUX.1 Kontext, FLUX.2;
      Qwen-Image-Edit sizes its input in multiples of 32 pixels, so its tokens divide by 4).
    - `size_multiple`: what width and height must be multiples of (latents an eighth of the
      image, packed in 2x2 patches by the transformers: 16).
    - `strength_rounds_down`: its image-to-image and inpainting pipelines denoise
      int(steps x strength) steps, none when that is under 1 (diffusers' SD and SDXL; the
      others denoise at least one step for any strength).
    """

    name: str
    pipeline: str
    presets: Mapping[str, Callable[[], DiffusionPipeline]]
    architectures: Mapping[str, Architecture] = field(default_factory=dict)
    image_pipelines: Mapping[str, str] = field(default_factory=dict)
    image_input: Literal["none", "variants", "edit", "required"] = "none"
    output: Literal["image", "video"] = "image"
    fps: int = 16
    defaults: Mapping[str, float] = field(default_factory=dict)
    call_names: Mapping[str, str] = field(default_factory=dict)
    adjust_call: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    edit_tokens: Callable[[dict[str, Any], int], int] | None = None
    size_multiple: int = 16
    strength_rounds_down: bool = False

    @property
    def pipeline_class(self) -> type[DiffusionPipeline]:
        import diffusers

        return getattr(diffusers, self.pipeline)

    def takes_masks(self) -> bool:
        return "inpaint" in self.image_pipelines


# generation defaults of the tiny presets: small images, few steps (pipelines' own defaults
# are sized for the real models, e.g. FLUX.1's 1024x1024 and 28 steps)
TINY_DEFAULTS = {"width": 64, "height": 64, "steps": 4}


# the size a pipeline that says nothing of its own is taken to be made for: today's models'
# (SDXL, FLUX.1, SD3, Qwen-Image, Z-Image)
USUAL_NATIVE_SIDE = 1024


def native_size(pipeline: DiffusionPipeline, defaults: Mapping[str, float]) -> tuple[int, int]:
    """(width, height) the model was made for: a preset's default size, else what its pipeline
    makes when asked for none: its call's own default (Wan's 832x480), its `default_sample_size`
    (SDXL, SD3, FLUX.1, Qwen-Image) or its UNet's sample size (SD 1.5's 64, 512 px) in latents,
    times the VAE's scale; else `USUAL_NATIVE_SIDE`."""
    if "width" in defaults and "height" in defaults:
        return int(defaults["width"]), int(defaults["height"])
    call = inspect.signature(type(pipeline).__call__).parameters
    width, height = (call[side].default if side in call else None for side in ("width", "height"))
    if isinstance(width, int) and isinstance(height, int):
        return width, height
    unet = getattr(pipeline, "unet", None)
    latents = getattr(pipeline, "default_sample_size", None) or getattr(getattr(unet, "config", None),
                                                                         "sample_size", None)
    scale = getattr(pipeline, "vae_scale_factor", None)
    if isinstance(latents, int) and isinstance(scale, int):
        return latents * scale, latents * scale
    return USUAL_NATIVE_SIDE, USUAL_NATIVE_SIDE
