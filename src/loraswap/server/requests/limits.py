"""The bounds of every request field, written once: `LIMITS` drives the checks of both APIs,
the words of their 400s and the bounds the OpenAPI schema publishes.

A bound is a number, or the `ServerConfig` field that sets it (`--max-width` ...). The
bounds of guidance and seed are the engine's own (`GenerateRequest`), read from there.
"""

import re
from dataclasses import dataclass
from typing import Any

from loraswap.engine.request import GenerateRequest
from loraswap.engine.sizes import check_fits
from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.media.images import ImageLimits
from loraswap.server.config import ServerConfig

Bound = int | float | str | None  # str: the ServerConfig field that sets it


def engine_bounds(field: str) -> tuple[float, float]:
    """The bounds `GenerateRequest` puts on `field`: inclusive, but for a `gt` low bound."""
    low = high = None
    for rule in GenerateRequest.model_fields[field].metadata:
        ge, gt, le, lt = (getattr(rule, bound, None) for bound in ("ge", "gt", "le", "lt"))
        low = ge if ge is not None else gt if gt is not None else low
        high = le if le is not None else lt - 1 if lt is not None else high  # lt: integers only
    return low, high


def image_limits(config: ServerConfig) -> ImageLimits:
    """The bounds of an input image file (`--max-image-mb`, `--max-image-pixels`)."""
    return ImageLimits(config.max_image_bytes, config.max_image_pixels)


@dataclass(frozen=True)
class Limit:
    """One field's bounds and the message that refuses a value outside them."""

    names: tuple[str, ...]  # as the APIs spell the field (HF `inputs` is OpenAI's `prompt`)
    message: str  # str.format fields: name, value (the length, for strings), low, high
    low: Bound = None
    high: Bound = None
    low_exclusive: bool = False  # the value must be above `low` (strength: more than 0)
    multiple_of: int | None = None
    length: bool = False  # the bounds are on the string's length
    blank: str | None = None  # the message for an empty or all-space string
    pattern: str | None = None
    choices: tuple[str, ...] = ()

    def bounds(self, config: ServerConfig) -> tuple[Any, Any]:
        return tuple(getattr(config, b) if isinstance(b, str) else b for b in (self.low, self.high))

    def check(self, name: str, value: Any, config: ServerConfig) -> None:
        """BadRequest(message) when `value` is outside the bounds, naming the field `name` as its
        `param` (OpenAI's error body names the field it refuses)."""
        if self.blank is not None and not value.strip():
            raise _naming(BadRequest(self.blank), name)
        low, high = self.bounds(config)
        number = len(value) if self.length else value
        refused = (
            (self.pattern is not None and not re.fullmatch(self.pattern, value))
            or (self.choices and value not in self.choices)
            or (low is not None and not (number > low if self.low_exclusive else number >= low))  # NaN too
            or (high is not None and not number <= high)
            or (self.multiple_of is not None and number % self.multiple_of)
        )
        if refused:
            raise _naming(BadRequest(self.message.format(name=name, value=number if self.length else repr(value),
                                                         low=low, high=high)), name)

    def schema(self, config: ServerConfig) -> dict:
        """The same bounds as JSON Schema keywords."""
        low, high = self.bounds(config)
        schema = {}
        if low is not None:
            schema["minLength" if self.length else "exclusiveMinimum" if self.low_exclusive else "minimum"] = low
        if high is not None:
            schema["maxLength" if self.length else "maximum"] = high
        if self.blank is not None:
            schema.update(minLength=max(1, schema.get("minLength", 1)), pattern=r"\S")
        if self.multiple_of is not None:
            schema["multipleOf"] = self.multiple_of
        if self.pattern is not None:
            schema["pattern"] = self.pattern
        if self.choices:
            schema["enum"] = list(self.choices)
        return schema


def _naming(error: BadRequest, field: str) -> BadRequest:
    """`error` with the field it refuses, for the error body's `param`."""
    error.param = field
    return error


_GUIDANCE = engine_bounds("guidance")
_SEED = engine_bounds("seed")
_STRENGTH = engine_bounds("strength")
_BETWEEN = "{name} {value} must be between {low} and {high}"

# in the order a request is checked: the first field out of bounds is the one named
LIMITS = (
    Limit(("response_format",), "response_format must be 'b64_json' or 'url', not {value}",
          choices=("b64_json", "url")),
    Limit(("n",), "n must be between {low} and {high}", low=1, high="max_images"),
    Limit(("size",), "size {value} must look like '1024x1024' (WIDTHxHEIGHT) or be 'auto'",
          pattern=r"^(auto|[0-9]{1,5}x[0-9]{1,5})$"),  # [0-9]: \d takes every script's digits
    Limit(("prompt", "inputs"), "the prompt has {value} characters; the limit is {high}", low=1,
          high="max_prompt_chars", length=True, blank="the prompt is empty"),
    Limit(("negative_prompt",), "the negative prompt has {value} characters; the limit is {high}",
          high="max_prompt_chars", length=True),
    Limit(("width",), "{name} {value} must be a multiple of 8 between {low} and {high}", low=8, high="max_width",
          multiple_of=8),
    Limit(("height",), "{name} {value} must be a multiple of 8 between {low} and {high}", low=8,
          high="max_height", multiple_of=8),
    Limit(("num_inference_steps",), _BETWEEN, low=1, high="max_steps"),
    Limit(("guidance_scale",), _BETWEEN, low=_GUIDANCE[0], high=_GUIDANCE[1]),
    Limit(("seed",), _BETWEEN, low=_SEED[0], high=_SEED[1]),
    Limit(("strength",), "strength {value} must be more than {low} and at most {high} (1 repaints the whole image)",
          low=_STRENGTH[0], high=_STRENGTH[1], low_exclusive=True),
    # a video has at most `max_video_frames` frames at 1 fps or more: a bound that keeps seconds x fps finite
    Limit(("seconds",), "seconds {value} must be more than {low} and at most {high}", low=0, high="max_video_frames",
          low_exclusive=True),
    Limit(("frames", "num_frames"), _BETWEEN, low=1, high="max_video_frames"),
    Limit(("fps",), _BETWEEN, low=1, high="max_video_fps"),
    Limit(("output_format",), "output_format must be 'png', 'jpeg' or 'webp', not {value}",
          choices=("png", "jpeg", "webp")),
    Limit(("output_compression",), _BETWEEN, low=0, high=100),
)


def check_limits(fields: dict[str, Any], config: ServerConfig) -> None:
    """BadRequest naming the first field of `fields` (as the APIs spell them) out of bounds;
    None values are absent fields."""
    for limit in LIMITS:
        for name in limit.names:
            if fields.get(name) is not None:
                limit.check(name, fields[name], config)


def check_model_size(request: GenerateRequest, capabilities: dict, model: str) -> None:
    """400 naming the bound for a size asked beyond the largest `model` makes (its capabilities'
    `max_size`), where the model is known before the request reaches it (a video job, refused
    now rather than failed later). A size taken from the input image is the model's to scale."""
    bound = capabilities.get("max_size")
    if bound and request.width and request.height and not request.size_from_image:
        check_fits(model, (bound[0], bound[1]), request.width, request.height)


def check_model_step_cache(request: GenerateRequest, capabilities: dict, model: str) -> None:
    """422 for a step cache `model` does not serve (its capabilities' `step_caches`), where the
    model is known before the request reaches it (a video job)."""
    method = (request.step_cache or "off").partition(":")[0]
    if method != "off" and "step_caches" in capabilities and method not in capabilities["step_caches"]:
        served = ", ".join(["off", *capabilities["step_caches"]])
        raise UnsupportedInput(f"{model} serves the step caches {served}, not {method}")


def schema_limits(config: ServerConfig) -> dict[str, dict]:
    """JSON Schema keywords by field name, for the OpenAPI document."""
    return {name: limit.schema(config) for limit in LIMITS for name in limit.names}


def constrain(node, limits: dict[str, dict]) -> None:
    """Add `limits` to every property of those names in a JSON Schema (the non-null branch of
    an optional one), nested ones included (HF `target_size.width`); a bound the property sets
    itself stays (A1111's `seed` takes -1)."""
    if isinstance(node, list):
        for item in node:
            constrain(item, limits)
        return
    if not isinstance(node, dict):
        return
    for name, prop in (node.get("properties") or {}).items():
        if name in limits and isinstance(prop, dict):
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") != "null":
                    branch.update({key: bound for key, bound in limits[name].items() if key not in branch})
    for value in node.values():
        constrain(value, limits)
