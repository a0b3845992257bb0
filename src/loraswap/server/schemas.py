"""Request bodies of the two HTTP APIs (Hugging Face Inference API, OpenAI images API) and
their header and size fields, as typed Python."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..adapters.source import check_adapter_id
from ..errors import BadRequest


class TargetSize(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    width: int
    height: int


class HFParameters(BaseModel):
    """Hugging Face Inference API text-to-image parameters (strict types: `"seed": true` is refused,
    not read as 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    target_size: TargetSize | None = None
    seed: int | None = None


class ApiBody(BaseModel):
    """A request body of one API, read into the fields both APIs share (`fields`)."""

    example: ClassVar[str]  # a valid body, quoted when a body is not JSON
    names_blend: ClassVar[bool]  # whether the model the request names may be a blend (`id1:0.8, id2:0.5`)

    @classmethod
    def parse(cls, body: Any) -> "ApiBody":
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise BadRequest(describe(e.errors())) from None

    def fields(self) -> dict[str, Any]:
        """The request's fields as the limits name them (`limits.LIMITS`), and `model`: what the
        body names as the model, if anything."""
        raise NotImplementedError


class HFRequest(ApiBody):
    model_config = ConfigDict(extra="forbid", strict=True)
    example: ClassVar[str] = '{"inputs": "a prompt", "parameters": {...}}'
    names_blend: ClassVar[bool] = False  # the path names one adapter, as the HF API names one model

    inputs: str
    parameters: HFParameters = Field(default_factory=HFParameters)

    @classmethod
    def parse(cls, body: Any) -> "HFRequest":
        return super().parse({"inputs": body} if isinstance(body, str) else body)  # a bare prompt

    def fields(self) -> dict[str, Any]:
        p = self.parameters
        if p.target_size and (p.width is not None or p.height is not None):
            raise BadRequest("parameters give both width/height and target_size: give one of them")
        size = p.target_size or p
        return {"prompt": self.inputs, "negative_prompt": p.negative_prompt, "width": size.width,
                "height": size.height, "num_inference_steps": p.num_inference_steps,
                "guidance_scale": p.guidance_scale, "seed": p.seed}


class OpenAIImageRequest(ApiBody):
    """OpenAI images API (`POST /v1/images/generations`); `seed` and `negative_prompt` are extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)  # quality, style, user, ... have no meaning here
    example: ClassVar[str] = '{"prompt": "a prompt", "model": "an-adapter", "size": "1024x1024"}'
    names_blend: ClassVar[bool] = True

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str = "b64_json"
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None

    def fields(self) -> dict[str, Any]:
        return self.model_dump()


def describe(errors) -> str:
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


def parse_lora_header(value: str | None) -> list[tuple[str, float]]:
    """`id1:0.8, id2:0.5` -> [(id1, 0.8), (id2, 0.5)]; a missing weight is 1.0."""
    if value is None or not value.strip():
        return []
    loras = []
    for part in value.split(","):
        adapter_id, _, weight = part.strip().partition(":")
        if "/" in weight or "\\" in part:  # a URL or a path (C:\x), not an id with a weight
            check_adapter_id(part.strip())
        try:
            loras.append((adapter_id.strip(), float(weight) if weight.strip() else 1.0))
        except ValueError:
            raise BadRequest(f"lora header part {part.strip()!r}: the weight after ':' must be a number") from None
        if not -10.0 <= loras[-1][1] <= 10.0 or loras[-1][1] != loras[-1][1]:
            raise BadRequest(f"lora weight {weight.strip()} is out of range [-10, 10]")
    return loras
