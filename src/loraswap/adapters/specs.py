"""Adapter specs as people write them: `ID[:WEIGHT]`, comma-separated to blend.

One reader for every place a user names adapters: the `lora` header, the `model` field of
the OpenAI bodies, `/models/{id}` and the CLI's `--lora`, so each accepts the same specs
and refuses the same ones with the same words.
"""

import math

from ..errors import BadRequest
from .source import check_adapter_id

MAX_WEIGHT = 10.0  # a weight past this is a typo, not a blend


def parse_adapter_specs(value: str | None) -> list[tuple[str, float]]:
    """`id1:0.8, id2:0.5` -> [(id1, 0.8), (id2, 0.5)]; a missing weight is 1.0."""
    if value is None or not value.strip():
        return []
    return [_parse_one(part.strip()) for part in value.split(",")]


def _parse_one(part: str) -> tuple[str, float]:
    adapter_id, _, weight = part.partition(":")
    if "/" in weight or "\\" in part:  # a URL or a path (C:\x), not an id with a weight
        check_adapter_id(part)
    try:
        value = float(weight) if weight.strip() else 1.0
    except ValueError:
        raise BadRequest(f"adapter {part!r}: the weight after ':' must be a number") from None
    if not (math.isfinite(value) and -MAX_WEIGHT <= value <= MAX_WEIGHT):
        raise BadRequest(f"adapter {part!r}: the weight {weight.strip()} is out of range "
                         f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
    return adapter_id.strip(), value
