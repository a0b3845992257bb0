"""The shape of one generation request, as every API's parse hands it to the engine."""

from collections.abc import Iterable
from typing import Annotated, Literal

from PIL import Image
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, TypeAdapter

from loraswap.adapters.reference import AdapterRef, as_refs

# the adapters of a request, as refs (`adapters/reference.py`); `(id, weight)` pairs are made
# into refs by their ids (scripts, tests, a request kept as JSON), and as JSON a request keeps
# `[id, weight]` pairs: never a URL (a video job keeps those apart, `videos/job.py`)
Adapters = Annotated[list[AdapterRef], BeforeValidator(as_refs),
                     PlainSerializer(lambda refs: [[ref.adapter_id, ref.scale] for ref in refs])]
ADAPTERS = TypeAdapter(Adapters)  # a request's `loras` checked alone, as the field checks them


class GenerateRequest(BaseModel):
    """One image or video: prompt, sampling parameters, the adapters to blend (refs), and
    for image inputs the image (and the mask, white where to paint) already decoded and checked
    by the caller; for video models the number of frames."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    prompt: str
    negative_prompt: str | None = None
    steps: int | None = Field(None, ge=1, le=200)
    guidance: float | None = Field(None, ge=0, le=50)
    width: int | None = Field(None, ge=8, le=4096, multiple_of=8)
    height: int | None = Field(None, ge=8, le=4096, multiple_of=8)
    seed: int | None = Field(None, ge=0, lt=2**63)
    loras: Adapters = Field(default_factory=list)
    image: Image.Image | None = None
    mask: Image.Image | None = None
    strength: float | None = Field(None, gt=0, le=1)
    frames: int | None = Field(None, ge=1, le=1000)
    output: Literal["image", "video"] | None = None  # what the API asked for (None: what the model makes)
    max_frames: int | None = Field(None, ge=1)  # the server's limit, held against the model's default too
    # width and height are the input image's (no size asked): a model whose largest size is
    # smaller scales them down to fit rather than refusing them (`PipelineCalls.sized`)
    size_from_image: bool = False
    # "off", a step cache setting in its canonical text (`step_cache.canonical`), or None: the server's default
    step_cache: str | None = None

    def with_loras(self, loras: Iterable) -> "GenerateRequest":
        """A copy with `loras` as its adapters, checked as the field checks them (refs as they
        are; `(id, weight)` pairs made refs by their ids): `model_copy(update=...)` checks nothing."""
        return self.model_copy(update={"loras": ADAPTERS.validate_python(loras)})
