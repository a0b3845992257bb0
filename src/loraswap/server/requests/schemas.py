"""Request bodies of the two HTTP APIs (Hugging Face Inference API, OpenAI images API) and
their header and size fields, as typed Python."""

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.media.images import looks_like_image


class LoraEntry(BaseModel):
    """One adapter of a body's `loras` list, as fal and Together name it: `path` is an adapter
    id, a hub id, an https:// URL, a Civitai AIR or s3://bucket/key; `scale` its weight."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(max_length=2048, description="An adapter id, owner/name[@revision] (--hub), an https:// "
                      "URL of a .safetensors file, civitai:MODEL@VERSION or an AIR, or s3://bucket/key.")
    scale: float = Field(1.0, description="The adapter's weight in the blend.")


def _json_list(value: Any) -> Any:
    """A form field carries a list as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            raise ValueError('loras in a form is JSON text: [{"path": "...", "scale": 1.0}]') from None
    return value


def _loras(loras: list[LoraEntry] | None, image_loras: list[LoraEntry] | None = None) -> list[tuple[str, float]]:
    if loras is not None and image_loras is not None:
        raise BadRequest("the body gives both loras and image_loras (the same list): give one")
    return [(entry.path, entry.scale) for entry in (loras if loras is not None else image_loras or [])]


PREVIEW_FULL_DOC = ("Streamed: previews decoded by the VAE (the image as it would end at that step; each costs a "
                    "decode) rather than sketched from the latents (an extension).")
METADATA_DOC = ("false: the image carries no record of what made it (A1111's infotext and a JSON record, in PNG "
                "text chunks or EXIF); default: the server's --image-metadata (an extension).")


class TargetSize(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    width: int
    height: int


class HFParameters(BaseModel):
    """Hugging Face Inference API text-to-image and image-to-image parameters (strict types:
    `"seed": true` is refused, not read as 1). `seed`, `strength` and `mask` are extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = Field(None, description="Image-to-image: the prompt (`inputs` is then the image).")
    strength: float | None = Field(None, description="Image-to-image: how much of the image to repaint "
                                   "(1: all of it); default: the model's.")
    mask: str | None = Field(None, description="Inpainting: a base64 PNG, JPEG or WebP of the image's size, "
                             "white (or transparent) where to repaint.")
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    target_size: TargetSize | None = None
    seed: int | None = None
    loras: list[LoraEntry] | None = Field(None, description="Adapters to blend, by id, URL, Civitai AIR or "
                                          "bucket: [{\"path\": ..., \"scale\": 1.0}] (an extension).")
    step_cache: str | None = Field(None, description="Skip the steps a cache can stand in for: \"off\", or "
                                   "METHOD[:key=value,...] (first-block:threshold=0.08, taylorseer:interval=4, "
                                   "magcache) within what the server allows; default: the server's (an extension).")
    metadata: bool | None = Field(None, description=METADATA_DOC)
    stream: bool | None = Field(None, description="true: answered as server-sent events (progress, previews, then "
                                "the image), as `Accept: text/event-stream` asks; false: not, whatever it says "
                                "(an extension).")
    preview_every: int | None = Field(None, ge=1, description="Streamed: a preview of the image so far every N "
                                      "steps (an extension).")
    preview_full: bool | None = Field(None, description=PREVIEW_FULL_DOC)


class ApiBody(BaseModel):
    """A request body of one API, read into the fields both APIs share (`fields`)."""

    example: ClassVar[str]  # a valid body, quoted when a body is not JSON
    names_blend: ClassVar[bool]  # whether the model the request names may be a blend (`id1:0.8, id2:0.5`)
    takes_images: ClassVar[bool] = False  # the body may carry an image and a mask (beyond max_body_bytes)
    form: ClassVar[bool] = False  # the body is multipart/form-data, not JSON
    output: ClassVar[str] = "image"  # what the route answers with: "image" or "video"
    takes_empty_prompt: ClassVar[bool] = False  # an empty prompt (its adapter tags cut out) is taken, not a 400
    mask_convention: ClassVar[str] = "openai"  # how a mask's transparency reads (`media.images.read_mask`)

    @classmethod
    def parse(cls, body: Any) -> "ApiBody":
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise BadRequest(invalid_request_message(e.errors())) from None

    def fields(self) -> dict[str, Any]:
        """The request's fields as the limits name them (`limits.LIMITS`), `model`: what the
        body names as the model, if anything, and `image` and `mask`: bytes, or base64 text."""
        raise NotImplementedError

    def image_bytes(self) -> int:
        """How many bytes of the body its image and mask take (the rest is held to max_body_bytes)."""
        return sum(len(self.fields().get(name) or "") for name in ("image", "mask"))


class HFRequest(ApiBody):
    """Text-to-image: `inputs` is the prompt. Image-to-image (huggingface_hub's `image_to_image`):
    `inputs` is the image, base64, and `parameters.prompt` the prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)
    example: ClassVar[str] = ('{"inputs": "a prompt", "parameters": {...}}, or {"inputs": "<base64 image>", '
                              '"parameters": {"prompt": "a prompt", ...}}')
    names_blend: ClassVar[bool] = False  # the path names one adapter, as the HF API names one model
    takes_images: ClassVar[bool] = True

    inputs: str = Field(description="The prompt; with `parameters.prompt`, the image (base64 PNG, JPEG or WebP).")
    parameters: HFParameters = Field(default_factory=HFParameters)

    @classmethod
    def parse(cls, body: Any) -> "HFRequest":
        return super().parse({"inputs": body} if isinstance(body, str) else body)  # a bare prompt

    def fields(self) -> dict[str, Any]:
        p = self.parameters
        if p.target_size and (p.width is not None or p.height is not None):
            raise BadRequest("parameters give both width/height and target_size: give one of them")
        size = p.target_size or p
        image_to_image = p.prompt is not None
        if not image_to_image and looks_like_image(self.inputs):
            raise BadRequest("inputs is an image but parameters.prompt is missing: image-to-image takes the prompt "
                             "in parameters.prompt")
        return {"prompt": p.prompt if image_to_image else self.inputs, "negative_prompt": p.negative_prompt,
                "width": size.width, "height": size.height, "num_inference_steps": p.num_inference_steps,
                "guidance_scale": p.guidance_scale, "seed": p.seed, "strength": p.strength,
                "image": self.inputs if image_to_image else None, "mask": p.mask, "loras": _loras(p.loras),
                "step_cache": p.step_cache, "metadata": p.metadata}


class OpenAIImageRequest(ApiBody):
    """OpenAI images API (`POST /v1/images/generations`); `seed` and `negative_prompt` are extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)  # quality, style, user, ... have no meaning here
    example: ClassVar[str] = '{"prompt": "a prompt", "model": "an-adapter", "size": "1024x1024"}'
    names_blend: ClassVar[bool] = True

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str = Field("b64_json", description="b64_json: each image in the answer, base64; url: a URL "
                                 "on this server, served to the same API key for --image-url-ttl-s.")
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    loras: list[LoraEntry] | None = Field(None, description="Adapters to blend, by id, URL, Civitai AIR or "
                                          "bucket: [{\"path\": ..., \"scale\": 1.0}] (an extension).")
    image_loras: list[LoraEntry] | None = Field(None, description="The same list, as Together names it.")
    output_format: str = Field("png", description="The images' file format: png, jpeg or webp.")
    output_compression: int | None = Field(None, description="jpeg and webp: the quality, 0-100 (higher: larger "
                                           "files, finer detail); default 95.")
    metadata: bool | None = Field(None, description=METADATA_DOC)
    step_cache: str | None = Field(None, description="Skip the steps a cache can stand in for: \"off\", or "
                                   "METHOD[:key=value,...] (first-block:threshold=0.08, taylorseer:interval=4, "
                                   "magcache) within what the server allows; default: the server's (an extension).")
    stream: bool = Field(False, description="true: answered as server-sent events, OpenAI's partial_image events "
                         "then completed (each image's b64_json).")
    partial_images: int | None = Field(None, ge=0, le=3, description="Streamed: how many previews of each image "
                                       "come before it, spread over its steps (fewer when it has too few steps).")
    preview_full: bool | None = Field(None, description=PREVIEW_FULL_DOC)

    def fields(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"loras", "image_loras"}), "loras": _loras(self.loras, self.image_loras)}


class OpenAIEditRequest(OpenAIImageRequest):
    """OpenAI images API edits (`POST /v1/images/edits`), a multipart form: the image file, an
    optional mask file, and the fields of generations, as text (hence lax types: `n=2` arrives
    as "2"). `strength` is an extension."""

    model_config = ConfigDict(extra="ignore", strict=False)  # background, quality, input_fidelity, ...
    example: ClassVar[str] = "a multipart form: image (file), prompt, model, size, mask (file)"
    takes_images: ClassVar[bool] = True
    form: ClassVar[bool] = True

    image: bytes = Field(description="The image to edit: a PNG, JPEG or WebP file.")
    mask: bytes | None = Field(None, description="A file of the image's size: transparent (or, without "
                               "transparency, white) where to repaint.")
    strength: float | None = Field(None, description="How much of the image to repaint (1: all of it).")

    _loras_as_json = field_validator("loras", "image_loras", mode="before")(_json_list)

    @field_validator("image", "mask", mode="before")
    @classmethod
    def _a_file(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ValueError("send it as a file part of the form, not as a text field")
        return value


class OpenAIVideoRequest(ApiBody):
    """OpenAI videos API (`POST /v1/videos`), a multipart form as the openai client sends it
    (hence lax types: `seed=5` arrives as "5"). `frames` (or `num_frames`), `fps`, `seed`,
    `negative_prompt`, `num_inference_steps` and `guidance_scale` are extensions."""

    model_config = ConfigDict(extra="forbid", strict=False)  # a misspelt extension is refused, not ignored
    example: ClassVar[str] = "a multipart form: prompt, model, seconds, size (curl -F prompt=... -F model=...)"
    names_blend: ClassVar[bool] = True
    form: ClassVar[bool] = True
    output: ClassVar[str] = "video"

    prompt: str
    model: str | None = None
    seconds: float | None = Field(None, allow_inf_nan=False, description="Length in seconds (the openai client "
                                  "sends '4', '8' or '12'); frames = seconds x fps. Default: the model's.")
    size: str | None = None
    input_reference: bytes | str | None = Field(None, description="An image to start from: not supported yet.")
    frames: int | None = None
    num_frames: int | None = Field(None, description="diffusers' name for frames.")
    fps: int | None = Field(None, description="The MP4's frame rate; default: the model's.")
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    loras: list[LoraEntry] | None = Field(None, description="Adapters to blend, as JSON text: "
                                          "[{\"path\": ..., \"scale\": 1.0}] (an extension).")
    step_cache: str | None = Field(None, description="Skip the steps a cache can stand in for: \"off\", or "
                                   "METHOD[:key=value,...] (first-block:threshold=0.08, taylorseer:interval=4, "
                                   "magcache) within what the server allows; default: the server's (an extension).")
    webhook_url: str | None = Field(None, max_length=2048, description="Called once when the job ends (completed, "
                                    "failed or deleted), with the job as JSON, signed as Standard Webhooks (an "
                                    "extension; the server's --webhook-secret and --webhook-allow).")

    _loras_as_json = field_validator("loras", mode="before")(_json_list)

    def fields(self) -> dict[str, Any]:
        if self.input_reference is not None:
            raise UnsupportedInput("input_reference (an image to start the video from) is not supported yet: "
                                   "this server makes videos from a prompt alone")
        lengths = [name for name in ("seconds", "frames", "num_frames") if getattr(self, name) is not None]
        if len(lengths) > 1:
            raise BadRequest(f"the form gives both {lengths[0]} and {lengths[1]}: give one length")
        return {**self.model_dump(exclude={"input_reference", "loras"}), "loras": _loras(self.loras)}


def invalid_request_message(errors) -> str:
    """pydantic's errors as one line: `invalid request: parameters.seed: Input should be ...`."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """`'1024x768'` -> (1024, 768); `'auto'` or None -> the model's default. The form is
    checked before, by the `size` limit (`limits.LIMITS`)."""
    if size in (None, "auto"):
        return None, None
    width, _, height = size.partition("x")
    return int(width), int(height)
