"""Request bodies of the two HTTP APIs, and their translation to a GenerateRequest."""

import re

from pydantic import BaseModel, ConfigDict, Field

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


class HFRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: str
    parameters: HFParameters = Field(default_factory=HFParameters)


class OpenAIImageRequest(BaseModel):
    """OpenAI images API (`POST /v1/images/generations`); `seed` and `negative_prompt` are extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)  # quality, style, user, ... have no meaning here

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str = "b64_json"
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None


_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size in (None, "auto"):
        return None, None
    match = _SIZE.match(size)
    if not match:
        raise BadRequest(f"size {size!r} must look like '1024x1024' (WIDTHxHEIGHT)")
    return int(match[1]), int(match[2])


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
