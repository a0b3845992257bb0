"""Adapter specs as people write them: `NAME[:WEIGHT]`, comma-separated to blend, and the
`loras` list of a request body (`[{"path": NAME, "scale": WEIGHT}]`).

One reader for every place a user names adapters: the `lora` header, the `model` field of
the OpenAI bodies, `/models/{id}`, the bodies' `loras` and the CLI's `--lora`, so each
accepts the same names and refuses the same ones with the same words. A name is an
adapter id or a reference to a file elsewhere (a URL, a Civitai AIR, an object in a
bucket); each comes out as the id it is served under (`references.adapter_id_of`).
"""

import math

from ..errors import BadRequest
from .references import adapter_id_of, looks_like_reference, shown

MAX_WEIGHT = 10.0  # a weight past this is a typo, not a blend


def parse_adapter_specs(value: str | None) -> list[tuple[str, float]]:
    """`id1:0.8, id2:0.5` -> [(id1, 0.8), (id2, 0.5)]; a missing weight is 1.0."""
    if value is None or not value.strip():
        return []
    return [_parse_one(part.strip()) for part in value.split(",")]


def adapter_with_weight(name: str, weight: float | int | None) -> tuple[str, float]:
    """One entry of a body's `loras` list: the name's id and its weight (1.0 when not given)."""
    value = 1.0 if weight is None else float(weight)
    _check_weight(name, value, str(weight))
    return adapter_id_of(name.strip()), value


def _parse_one(part: str) -> tuple[str, float]:
    name, weight = _split_weight(part)
    try:
        value = float(weight) if weight.strip() else 1.0
    except ValueError:
        raise BadRequest(f"adapter {shown(part)!r}: the weight after ':' must be a number") from None
    _check_weight(part, value, weight.strip())
    return adapter_id_of(name.strip()), value


def _split_weight(part: str) -> tuple[str, str]:
    """(name, weight text): a reference (which has colons of its own) has a weight only after
    its last colon, and only when that is a number; an id has one after its first colon."""
    if not looks_like_reference(part):
        name, _, weight = part.partition(":")
        if "/" in weight or "\\" in part:  # a path (C:\x) or an unknown scheme, not an id with a weight
            adapter_id_of(part)
        return name, weight
    name, colon, weight = part.rpartition(":")
    try:
        float(weight)
    except ValueError:
        return part, ""
    return name, weight


def _check_weight(name: str, value: float, weight: str) -> None:
    if not (math.isfinite(value) and -MAX_WEIGHT <= value <= MAX_WEIGHT):
        raise BadRequest(f"adapter {shown(name)!r}: the weight {weight} is out of range "
                         f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
