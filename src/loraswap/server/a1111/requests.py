"""A1111's txt2img and img2img bodies (`POST /sdapi/v1/txt2img`, `/sdapi/v1/img2img`), as
stable-diffusion-webui's API takes them and the `webuiapi` client sends them, read into the
fields every API shares (`fields`).

A1111's fields fall in four groups:
- mapped: `prompt` (empty too, as A1111 takes it), `negative_prompt`, `steps`, `cfg_scale`,
  `width`, `height`, `seed` (-1: one drawn), `batch_size` x `n_iter` images (seed, seed + 1,
  ...), and for img2img `init_images` (one), `mask` (read as A1111 reads it:
  `media.images.read_mask`) and `denoising_strength`; a field left out is the model's default
  (A1111's would be 50 steps, CFG 7, 512x512);
- read by the route: `send_images`, `override_settings.sd_model_checkpoint` (a hosted model),
  `sampler_name` (or `sampler_index`) and `scheduler` (`check_sampler`), both checked before
  an image is decoded;
- no effect on the picture, any value taken: saving on A1111's disk, task ids, and the settings
  of a feature that is off (hires fix's `hr_*` while `enable_hr` is false, ...);
- what this server does not do (face restoration, tiling, variation seeds, scripts, ...): taken
  at A1111's and webuiapi's defaults only, anything else a 400 naming the field, never ignored.
A field A1111 does not have is a 400 too (A1111 would ignore it).
"""

import json
from typing import Any, ClassVar

from pydantic import ConfigDict, Field

from loraswap.errors import BadRequest
from loraswap.server.requests.schemas import ApiBody

# the sampler and scheduler clients send when they ask for none in particular: A1111's default
# sampler, as webuiapi sends it, and A1111's "Automatic" scheduler (the sampler's own)
DEFAULT_SAMPLERS = ("", "euler a")
DEFAULT_SCHEDULERS = ("", "automatic")

# fields that change nothing here, whatever their value
_NO_EFFECT = {"save_images", "do_not_save_samples", "do_not_save_grid", "override_settings_restore_afterwards",
              "force_task_id", "comments", "do_not_reload_embeddings", "seed_enable_extras",
              "subseed",  # used only with a subseed_strength
              "refiner_switch_at",  # used only with a refiner_checkpoint
              "image_cfg_scale"}  # used only by instruct-pix2pix models
_NO_EFFECT_TXT2IMG = {"denoising_strength", "firstphase_width", "firstphase_height", "hr_scale", "hr_upscaler",
                      "hr_second_pass_steps", "hr_resize_x", "hr_resize_y", "hr_checkpoint_name", "hr_sampler_name",
                      "hr_scheduler", "hr_prompt", "hr_negative_prompt", "hr_additional_modules",
                      "token_merging_ratio_hr"}  # all of them used only with enable_hr
# features this server does not have: the values that leave them off (A1111's defaults, webuiapi's)
_DEFAULTS_ONLY: dict[str, tuple] = {
    "enable_hr": (False,), "restore_faces": (False,), "tiling": (False,), "subseed_strength": (0,),
    "seed_resize_from_h": (-1, 0), "seed_resize_from_w": (-1, 0), "eta": (1,), "s_min_uncond": (0,),
    "s_churn": (0,), "s_tmax": (0,), "s_tmin": (0,), "s_noise": (1,), "styles": ([],), "script_name": ("",),
    "script_args": ([],), "alwayson_scripts": ({},), "refiner_checkpoint": ("", "None"),
    "disable_extra_networks": (False,), "token_merging_ratio": (0,), "infotext": ("",)}
_DEFAULTS_ONLY_IMG2IMG: dict[str, tuple] = {
    "resize_mode": (0,),  # "just resize", what this server does to an input of another size
    "mask_blur": (0, 4), "mask_blur_x": (0, 4), "mask_blur_y": (0, 4), "inpainting_fill": (0, 1),
    "inpaint_full_res": (True, False), "inpaint_full_res_padding": (0,), "inpainting_mask_invert": (0,),
    "initial_noise_multiplier": (1,), "latent_mask": (), "include_init_images": (False,)}
_OVERRIDE_DEFAULTS: dict[str, tuple] = {"CLIP_stop_at_last_layers": (1,), "sd_vae": ("Automatic", "None")}
CHECKPOINT = "sd_model_checkpoint"


class A1111Txt2Img(ApiBody):
    """A1111's `StableDiffusionTxt2ImgProcessingAPI`: the fields this server maps typed, the
    rest checked by name (see the module's docstring)."""

    model_config = ConfigDict(extra="allow", strict=True)
    example: ClassVar[str] = '{"prompt": "a red circle <lora:outline:1>", "steps": 20, "width": 32, "height": 32}'
    names_blend: ClassVar[bool] = False
    takes_empty_prompt: ClassVar[bool] = True  # as A1111 does: webuiapi's prompt is "" unless given
    no_effect: ClassVar[set[str]] = _NO_EFFECT | _NO_EFFECT_TXT2IMG
    defaults_only: ClassVar[dict[str, tuple]] = _DEFAULTS_ONLY

    # empty too, as A1111 takes it: its own minLength and pattern stand before the limits' (`limits.constrain`)
    prompt: str = Field("", description="The prompt; <lora:NAME:WEIGHT> tags in it name adapters.",
                        json_schema_extra={"minLength": 0, "pattern": ""})
    negative_prompt: str | None = None
    steps: int | None = Field(None, description="Denoising steps; default: the model's.")
    cfg_scale: float | None = Field(None, description="Guidance scale; default: the model's.")
    width: int | None = None
    height: int | None = None
    seed: int | None = Field(-1, ge=-1, lt=2**63, description="-1: a seed drawn for each image; else image i gets "
                             "seed + i.")
    batch_size: int = Field(1, ge=1)
    n_iter: int = Field(1, ge=1)
    sampler_name: str | None = Field(None, description="The model's own sampler, or A1111's default (Euler a), "
                                     "which runs as the model's own: the answer's info names the one that ran.")
    sampler_index: str | None = Field(None, description="sampler_name's old name.")
    scheduler: str | None = Field(None, description="Automatic (the sampler's own) only.")
    override_settings: dict[str, Any] | None = Field(None, description="sd_model_checkpoint: the hosted model "
                                                     "to use (GET /sdapi/v1/sd-models).")
    send_images: bool = True

    def fields(self) -> dict[str, Any]:
        self._check_unmapped()
        return {"prompt": self.prompt, "negative_prompt": self.negative_prompt or None,
                "num_inference_steps": self.steps, "guidance_scale": self.cfg_scale, "width": self.width,
                "height": self.height, "seed": None if self.seed in (None, -1) else self.seed,
                "n": self.batch_size * self.n_iter, "loras": [], **self._image_fields()}

    def _image_fields(self) -> dict[str, Any]:
        return {}

    def checkpoint(self) -> str | None:
        """The model `override_settings.sd_model_checkpoint` names, if any."""
        return (self.override_settings or {}).get(CHECKPOINT) or None

    def echo(self) -> dict[str, Any]:
        """The request as A1111 answers it in `parameters`: every field sent."""
        return self.model_dump()

    def _check_unmapped(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self.no_effect:
                continue
            if name not in self.defaults_only:
                raise BadRequest(f"{_shown(name)} is not an A1111 field this server takes: leave it out")
            _check_default(name, value, self.defaults_only[name])
        for name, value in (self.override_settings or {}).items():
            if name != CHECKPOINT:
                allowed = _OVERRIDE_DEFAULTS.get(name)
                if allowed is None:
                    raise BadRequest(f"override_settings {_shown(name)} is a setting this server does not have: leave "
                                     "it out")
                _check_default(f"override_settings.{name}", value, allowed)


class A1111Img2Img(A1111Txt2Img):
    """A1111's `StableDiffusionImg2ImgProcessingAPI`: one input image (`init_images`), an optional
    mask (white repaints) and how much to repaint (`denoising_strength`)."""

    example: ClassVar[str] = ('{"init_images": ["<base64 PNG>"], "prompt": "a red circle", "denoising_strength": 0.6, '
                              '"width": 32, "height": 32}')
    takes_images: ClassVar[bool] = True
    mask_convention: ClassVar[str] = "a1111"
    no_effect: ClassVar[set[str]] = _NO_EFFECT
    defaults_only: ClassVar[dict[str, tuple]] = _DEFAULTS_ONLY | _DEFAULTS_ONLY_IMG2IMG

    init_images: list[str] = Field(description="One image, base64 (a data: URL too).")
    mask: str | None = Field(None, description="Inpainting: a base64 image of the input's size, white where to "
                             "repaint (or, with transparency, opaque where to repaint, as A1111 reads it).")
    denoising_strength: float | None = Field(0.75, description="How much of the image to repaint (1: all of it).")

    def _image_fields(self) -> dict[str, Any]:
        if len(self.init_images) != 1:
            raise BadRequest(f"init_images holds {len(self.init_images)} images; this server takes one image per "
                             "request: send one (batch_size makes several from it)")
        return {"image": self.init_images[0], "mask": self.mask, "strength": self.denoising_strength}

    def image_bytes(self) -> int:
        return sum(map(len, self.init_images)) + len(self.mask or "")  # before `fields` checks the rest

    def echo(self) -> dict[str, Any]:
        return {**super().echo(), "init_images": None, "mask": None}  # as A1111 answers without include_init_images


def _check_default(name: str, value: Any, allowed: tuple) -> None:
    """400 for a value of a feature this server does not have other than those that leave it off."""
    if value is None or value in allowed:
        return
    leave = f" (or send {json.dumps(allowed[0])})" if allowed else ""
    raise BadRequest(f"{name} {_shown(value)} asks for what this server does not do, and would change the picture: "
                     f"leave it out{leave}")


def _shown(value: Any) -> str:
    """A value as the client wrote it (JSON), cut short."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_sampler(body: A1111Txt2Img, samplers: set[str] | None) -> None:
    """400 for a sampler or scheduler other than the model's own (`samplers`: A1111's names of the
    samplers of the models the request may go to; None: not known, as while the models load) or
    the defaults clients send, which run as the model's own."""
    for name in ("sampler_name", "sampler_index"):
        value = getattr(body, name)
        if value is not None and value.lower() not in DEFAULT_SAMPLERS and samplers is not None \
                and value not in samplers:
            own = f" ({', '.join(sorted(samplers))})" if samplers else ""
            raise BadRequest(f"{name} {value!r}: this server samples with each model's own sampler{own}; leave "
                             f"{name} out, or send the model's own")
    if body.scheduler is not None and body.scheduler.lower() not in DEFAULT_SCHEDULERS:
        raise BadRequest(f"scheduler {body.scheduler!r}: this server uses each model's own (A1111's Automatic): "
                         "leave scheduler out, or send Automatic")
