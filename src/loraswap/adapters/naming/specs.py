"""Adapter specs as people write them: `NAME[:WEIGHT]`, comma-separated to blend, and the
`loras` list of a request body (`[{"path": NAME, "scale": WEIGHT}]`).

One reader for every place a user names adapters: the `lora` header, the `model` field of
the OpenAI bodies, `/models/{id}`, the bodies' `loras` and the CLI's `--lora`, so each
accepts the same names and refuses the same ones with the same words. A name is an
adapter id or a reference to a file elsewhere (a URL, a Civitai AIR, an object in a
bucket); each comes out as an `AdapterRef` (`adapters/reference.py`): the id it is served
under, its weight, and for a URL the URL itself.

How a URL is written among others: a comma inside a URL belongs to it unless a space
follows the comma, so `https://h/a,b.safetensors` is one adapter and a URL is separated
from the next adapter by `, `. Its weight follows a colon after its path
(`https://h/a.safetensors:0.8`); a colon before the path is its port
(`http://127.0.0.1:18080` has weight 1). A weight is a decimal number in ASCII digits.
"""

import math
import re

from loraswap.adapters.reference import AdapterRef, looks_like_reference, shown
from loraswap.errors import BadRequest

MAX_WEIGHT = 10.0  # a weight past this is a typo, not a blend
# a decimal number in ASCII (float() also takes '١.٥', '1_0' and ' 1 '); inf and nan are
# numbers, refused as out of range
NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)",
                    re.IGNORECASE | re.ASCII)
URL_SCHEMES = ("https://", "http://")


def parse_adapter_specs(value: str | None) -> list[AdapterRef]:
    """`id1:0.8, id2:0.5` -> the refs of id1 (weight 0.8) and id2 (0.5); a missing weight is 1.0."""
    if value is None or not value.strip():
        return []
    return [_parse_one(part.strip()) for part in _entries(value)]


def adapter_with_weight(name: str, weight: float | int | None) -> AdapterRef:
    """One entry of a body's `loras` list: the name's ref with its weight (1.0 when not given)."""
    value = 1.0 if weight is None else float(weight)
    _check_weight(name, value, str(weight))
    return AdapterRef.named(name.strip(), value)


def _entries(value: str) -> list[str]:
    """The comma-separated entries, a URL's own commas (those no space follows) kept in it."""
    entries: list[str] = []
    for piece in value.split(","):
        if entries and entries[-1].lstrip().startswith(URL_SCHEMES) and piece[:1] not in ("", " ", "\t"):
            entries[-1] += "," + piece
        else:
            entries.append(piece)
    return entries


def _parse_one(part: str) -> AdapterRef:
    name, weight = _split_weight(part)
    if weight.strip() and not NUMBER.fullmatch(weight.strip()):
        raise BadRequest(f"adapter {shown(part)!r}: the weight after ':' must be a number (ASCII digits)")
    value = float(weight) if weight.strip() else 1.0
    _check_weight(part, value, weight.strip())
    return AdapterRef.named(name.strip(), value)


def _split_weight(part: str) -> tuple[str, str]:
    """(name, weight text): a reference (which has colons of its own) has a weight only after
    its last colon, and only when that is a number (after a URL's path, not its port); an id
    has one after its first colon."""
    if not looks_like_reference(part):
        name, _, weight = part.partition(":")
        if "/" in weight or "\\" in part:  # a path (C:\x) or an unknown scheme, not an id with a weight
            AdapterRef.named(part)
        return name, weight
    name, _, weight = part.rpartition(":")
    if not NUMBER.fullmatch(weight.strip()) or _in_authority(part, len(name)):
        return part, ""
    return name, weight


def _in_authority(part: str, colon: int) -> bool:
    """Whether the colon at `colon` of a URL comes before its path (in its host: the port)."""
    if not part.startswith(URL_SCHEMES):
        return False
    start = part.index("//") + 2
    path = part.find("/", start)
    return path == -1 or colon < path


def _check_weight(name: str, value: float, weight: str) -> None:
    if not (math.isfinite(value) and -MAX_WEIGHT <= value <= MAX_WEIGHT):
        raise BadRequest(f"adapter {shown(name)!r}: the weight {weight} is out of range "
                         f"[-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}]")
