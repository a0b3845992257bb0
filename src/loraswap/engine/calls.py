"""How a request becomes a pipeline call, for any family: which of the family's pipelines
takes it (text, img2img, inpainting, edit), its keyword arguments, and what comes out
(images, or a video's frames).

The image pipelines are made from the loaded one with `from_pipe`: they share its
modules, so a swap written into the weights serves them all, with no second copy.
"""

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from loraswap.adapters.files.hashes import FileDigest
from loraswap.engine.request import GenerateRequest
from loraswap.engine.sizes import LargestSize
from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.models import Family

TEXT, IMG2IMG, INPAINT = "text", "img2img", "inpaint"
SIGMA_SCHEDULES = ("karras", "exponential", "beta")  # diffusers' `use_NAME_sigmas` options
MOST_STEPS = next(rule.le for rule in GenerateRequest.model_fields["steps"].metadata if hasattr(rule, "le"))


@dataclass(frozen=True)
class AdapterRan:
    """One adapter of a call: its id, its weight, and the file it was read from (its stamp and
    SHA-256, hashed by the store as it read it; None where not known, as for a baseline's file)."""

    id: str
    weight: float
    stamp: tuple | None = None
    digest: FileDigest | None = None


@dataclass(frozen=True)
class Ran:
    """What one pipeline call ran with, as each image's record tells it: the request's values,
    else the model's defaults (the family's, else the pipeline's own)."""

    model: str
    sampler: str  # the scheduler's class, as diffusers names it
    steps: int | None
    guidance: float | None  # None: the pipeline takes no guidance
    strength: float | None  # with an input image: how much of it was repainted
    adapters: tuple[AdapterRan, ...] = ()
    algorithm: str | None = None  # the scheduler's `algorithm_type`, where it has one (`sde-dpmsolver++`)
    sigmas: str | None = None  # the noise schedule it was set to: `karras`, `exponential`, `beta` (None: its own)


class Stopped(Exception):
    """Raised by a step hook between denoising steps: the call's requests were all cancelled."""


def check_size_multiple(width: int | None, height: int | None, multiple: int, name: str) -> None:
    """UnsupportedInput (422) for a side that is not a multiple of what model `name` needs."""
    for side, value in (("width", width), ("height", height)):
        if value is not None and value % multiple:
            raise UnsupportedInput(f"{name} needs a {side} that is a multiple of {multiple}, not {value}")


class PipelineCalls:
    """The pipelines of one served model, keyed by the input they take, and their calls."""

    def __init__(self, pipeline: DiffusionPipeline, family: Family | None, defaults: dict[str, float],
                 largest: LargestSize | None = None):
        self.family = family
        self.defaults = defaults
        self.largest = largest  # the largest image it serves, held by `sized` (None: no bound)
        self._pipelines = {TEXT: pipeline}
        self._parameters: dict[str, Mapping[str, inspect.Parameter]] = {}

    def capabilities(self) -> dict:
        """What the model takes and makes, for clients that build their form from it (the
        playground): image input (`none`, `variants`, `edit`, `required`), masks, output,
        defaults, what width and height must be multiples of, the sampler (its scheduler's class)."""
        family, scheduler = self.family, getattr(self._pipelines[TEXT], "scheduler", None)
        return {"image_input": family.image_input if family else "none", "masks": bool(family and family.takes_masks()),
                "output": family.output if family else "image", "defaults": dict(self.defaults),
                "size_multiple": self.size_multiple,
                "max_size": [self.largest.width, self.largest.height] if self.largest else None,
                "sampler": type(scheduler).__name__ if scheduler is not None else None}

    @property
    def size_multiple(self) -> int:
        """What width and height must be multiples of: the family's, else the latents' 8."""
        return self.family.size_multiple if self.family else 8

    def sized(self, request: GenerateRequest) -> GenerateRequest:
        """`request` held to the model's largest size: a size asked beyond it is refused (400
        naming the bound); one taken from the input image (no size asked) is scaled down to
        fit, its shape kept, a multiple of `size_multiple`."""
        if self.largest is None:
            return request
        width = request.width or self.defaults.get("width") or self.largest.native[0]
        height = request.height or self.defaults.get("height") or self.largest.native[1]
        if request.size_from_image:
            width, height = self.largest.fit(width, height, self.size_multiple)
            return request.model_copy(update={"width": width, "height": height})
        self.largest.check(width, height)
        return request

    # ------------------------------------------------------------ which pipeline
    def task(self, request: GenerateRequest) -> str:
        """The pipeline `request` needs; UnsupportedInput (422) when the model has none for it."""
        self._check_output_and_size(request)
        return self._input_task(request)

    def _check_output_and_size(self, request: GenerateRequest) -> None:
        family, name = self.family, self.family.name if self.family else "this model"
        makes = family.output if family else "image"
        if request.output not in (None, makes) or (request.frames is not None and makes == "image"):
            fix = "use the videos API (POST /v1/videos)" if makes == "video" else "ask for an image"
            raise UnsupportedInput(f"{name} makes {makes}s, not {'images' if makes == 'video' else 'videos'}: {fix}")
        check_size_multiple(request.width or self.defaults.get("width"), request.height or self.defaults.get("height"),
                            self.size_multiple, name)

    def _input_task(self, request: GenerateRequest) -> str:
        family, name = self.family, self.family.name if self.family else "this model"
        image_input = family.image_input if family else "none"
        if request.mask is not None:
            if request.image is None:
                raise UnsupportedInput("a mask needs the image it applies to")
            if not (family and family.takes_masks()):
                raise UnsupportedInput(f"{name} does no inpainting: send the image without a mask")
            return INPAINT
        if request.image is not None:
            if image_input == "none":
                raise UnsupportedInput(f"{name} takes no image input: send a prompt only")
            return IMG2IMG if image_input == "variants" else TEXT
        if image_input == "required":
            raise UnsupportedInput(f"{name} is an edit model: send the image to edit")
        return TEXT

    def pipeline(self, task: str) -> DiffusionPipeline:
        """The pipeline for `task`, made from the loaded one on first use (shared modules)."""
        if task not in self._pipelines:
            import diffusers

            cls = getattr(diffusers, self.family.image_pipelines[task])
            self._pipelines[task] = cls.from_pipe(self._pipelines[TEXT])
            self._pipelines[task].set_progress_bar_config(disable=True)
        return self._pipelines[task]

    def parameters(self, task: str) -> Mapping[str, inspect.Parameter]:
        """The arguments `task`'s pipeline call takes, with their defaults (read once)."""
        if task not in self._parameters:
            self._parameters[task] = inspect.signature(self.pipeline(task).__call__).parameters
        return self._parameters[task]

    def warm_up_requests(self) -> list[GenerateRequest]:
        """What start-up generates once, so compiling happens before the first request: a
        prompt, and for an edit model a prompt with an image (its sequence is longer)."""
        text = GenerateRequest(prompt="warm-up", seed=0, steps=2)
        if not self.family or self.family.image_input not in ("edit", "required"):
            return [text]
        size = (self.defaults.get("width", 1024), self.defaults.get("height", 1024))
        edit = text.model_copy(update={"image": Image.new("RGB", size, (128, 128, 128))})
        return [edit] if self.family.image_input == "required" else [text, edit]

    # ------------------------------------------------------------ the call
    def arguments(self, task: str, requests: list[GenerateRequest]) -> dict:
        """The pipeline's keyword arguments for these requests (their shared parameters, the
        model's defaults for what they leave out), limited to what its `__call__` takes."""
        first, defaults, takes = requests[0], self.defaults, self.parameters(task)
        if first.strength is not None and "strength" not in takes:
            raise UnsupportedInput(f"{type(self.pipeline(task)).__name__} takes no strength: leave it out")
        self._check_frames(task, first)
        kwargs = dict(prompt=[r.prompt for r in requests])
        if self.images_on_device(task):
            kwargs["output_type"] = "pt"  # made 8-bit on the device (`to_pil`), not as floats on the host
        elif self.is_video:
            kwargs["output_type"] = "pil"
        guidance = first.guidance if first.guidance is not None else defaults.get("guidance")  # 0 is a value
        optional = dict(guidance_scale=guidance, num_inference_steps=first.steps or defaults.get("steps"),
                        width=first.width or defaults.get("width"), height=first.height or defaults.get("height"),
                        num_frames=first.frames or defaults.get("frames"), strength=first.strength)
        if any(r.negative_prompt for r in requests):
            optional["negative_prompt"] = [r.negative_prompt or "" for r in requests]
        size = (optional["width"], optional["height"])
        if first.image is not None:
            optional["image"] = [self._sized(r.image, size, takes) for r in requests]
        if first.mask is not None:
            optional["mask_image"] = [self._sized(r.mask, size, takes) for r in requests]
        renamed = self.family.call_names if self.family else {}
        for name, value in optional.items():
            name = renamed.get(name, name)
            if value is not None and name in takes:
                kwargs[name] = value
        self._check_denoising_steps(task, kwargs)
        adjust = self.family.adjust_call if self.family else None
        return adjust(kwargs) if adjust else kwargs

    def ran(self, task: str, kwargs: dict, model: str, held: list[tuple[object, float]]) -> Ran:
        """What the call made with `kwargs` (from `arguments`) runs with: the arguments, else
        the pipeline's defaults; `held`: the lease's (cache entry, weight) pairs."""
        def value(name: str):
            name = (self.family.call_names if self.family else {}).get(name, name)
            if name in kwargs:
                return kwargs[name]
            default = self.parameters(task)[name].default if name in self.parameters(task) else None
            return None if default is inspect.Parameter.empty else default

        adapters = tuple(AdapterRan(item.adapter_id, weight, getattr(item, "stamp", None),
                                    getattr(item, "digest", None)) for item, weight in held)
        scheduler = self.pipeline(task).scheduler
        config = getattr(scheduler, "config", {})
        sigmas = next((name for name in SIGMA_SCHEDULES if config.get(f"use_{name}_sigmas")), None)
        return Ran(model, type(scheduler).__name__, value("num_inference_steps"), value("guidance_scale"),
                   value("strength") if "image" in kwargs else None, adapters, config.get("algorithm_type"), sigmas)

    def _check_denoising_steps(self, task: str, kwargs: dict) -> None:
        """An image input's strength x steps of at least one where the family's pipelines round
        it down (`Family.strength_rounds_down`): with no step, their decode fails."""
        if not (self.family and self.family.strength_rounds_down) or "image" not in kwargs:
            return
        defaults = self.parameters(task)
        steps = kwargs.get("num_inference_steps", defaults["num_inference_steps"].default)
        strength = kwargs.get("strength", defaults["strength"].default)
        if int(steps * strength) >= 1:
            return
        least_strength = math.ceil(1000 / steps) / 1000  # rounded up: int(steps x it) is at least 1
        more_steps = math.ceil(1 / strength)
        raise BadRequest(f"strength {strength:g} x {steps} steps is {steps * strength:.3g}, under the one denoising "
                         f"step an image input needs: ask for a strength of at least {least_strength:g}"
                         + (f", or at least {more_steps} steps" if more_steps <= MOST_STEPS else ""))

    def _check_frames(self, task: str, request: GenerateRequest) -> None:
        """A video's frames within the server's limit, the model's default number included."""
        if not self.is_video or request.max_frames is None:
            return
        default = self.parameters(task)["num_frames"].default
        frames = request.frames or self.defaults.get("frames") or default
        if frames > request.max_frames:
            raise BadRequest(f"this model makes {frames} frames by default, over the limit of {request.max_frames}: "
                             "ask for fewer (frames, or seconds)")

    @staticmethod
    def _sized(image: Image.Image, size: tuple[int | None, int | None], takes: Mapping[str, object]) -> Image.Image:
        """The input at the asked size where the pipeline takes no size (SD and SDXL img2img
        make the input's size): the output is then the size the request asked for."""
        if "width" in takes or None in size or image.size == size:
            return image
        return image.resize(size, Image.Resampling.LANCZOS)

    def progress(self, task: str, on_step, on_latents=None) -> dict:
        """The pipeline's per-step callback calling `on_step(done, total)`, then
        `on_latents(done, total, latents, scheduler)` with the step's latents and the scheduler
        that made them (for pictures of them: it reads them, never changes them), where the
        pipeline takes one."""
        if (on_step is None and on_latents is None) or "callback_on_step_end" not in self.parameters(task):
            return {}

        def step_ended(pipeline, step: int, timestep, tensors: dict) -> dict:
            total = getattr(pipeline, "num_timesteps", None) or len(pipeline.scheduler.timesteps)
            if on_step is not None:
                on_step(step + 1, total)  # may raise `Stopped`, which ends the call
            if on_latents is not None and "latents" in tensors:
                on_latents(step + 1, total, tensors["latents"], pipeline.scheduler)
            return tensors

        return {"callback_on_step_end": step_ended}

    @property
    def is_video(self) -> bool:
        return self.family is not None and self.family.output == "video"

    def images_on_device(self, task: str) -> bool:
        """Whether the pipeline returns "pt" images as (batch, channels, height, width) in
        [0, 1] (those that postprocess with diffusers' VaeImageProcessor); others keep PIL."""
        return not self.is_video and "output_type" in self.parameters(task) and isinstance(
            getattr(self.pipeline(task), "image_processor", None), VaeImageProcessor)

    def outputs(self, task: str, output) -> list[list[Image.Image]]:
        """Each request's frames (one frame for an image model), as PIL images."""
        if self.is_video:
            return [list(video) for video in output.frames]
        images = output.images
        if self.images_on_device(task):
            images = to_pil(images)
        return [[image] for image in images]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """A pipeline's `output_type="pt"` images (batch, channels, height, width; in [0, 1]) as
    PIL images, bitwise the pixels diffusers' own "pil" output gives (float32, times 255,
    rounded half to even), computed where the images are: 1 byte per pixel and channel
    crosses to the host instead of floats converted there."""
    pixels = (images.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()
    return [Image.fromarray(p.squeeze(-1) if p.shape[-1] == 1 else p) for p in pixels]
