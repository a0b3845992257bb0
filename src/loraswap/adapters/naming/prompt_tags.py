"""Adapters named inside a prompt, as A1111, Forge and SD.Next write them:
`<lora:NAME>`, `<lora:NAME:WEIGHT>`, and the same with `lyco` (A1111's other name for it).

Read as A1111 reads its "extra networks" (`modules/extra_networks.py`): any `<word:args>` is a
tag, its arguments split at `:`, an argument with one `=` a named one; the tag is cut out of
the text and nothing else is changed (A1111 tidies no spaces or commas around it). The first
argument names the adapter (an adapter id, as the `lora` header names it), the second is its
weight (default 1). The id of a file elsewhere has a colon of its own (`civitai:1@2`,
`url:<hash>`, `s3:bucket/key`, as an image's infotext writes them): it is one argument, so
such a tag sent back selects the same adapter; a URL or an AIR is not (write its id). A1111
also takes a separate text-encoder and UNet weight (`<lora:NAME:TE:UNET>`, or
`te=`/`unet=`) and a rank to cut to (`dyn=`): one adapter has one weight here, so two
different weights, a rank, or any other argument are refused with the tag named, as is a tag
of a kind this server has no equivalent for (`<hypernet:...>`), never dropped. A1111 applies
the tags of the positive prompt only and sends a negative prompt's tags to the encoder as
words: here a tag in the negative prompt is refused.
"""

import re

from loraswap.adapters.naming.specs import NUMBER, adapter_with_weight
from loraswap.adapters.reference import CIVITAI, S3, URL_ID, AdapterRef
from loraswap.errors import BadRequest

ADAPTER_KINDS = ("lora", "lyco")  # lyco: the LyCORIS extension's tag, an alias of lora in A1111
TAG = re.compile(r"<(\w+):([^>]+)>")  # A1111's `re_extra_net`, so the same text is a tag in both


def take_adapter_tags(prompt: str, negative_prompt: str | None) -> tuple[str, list[AdapterRef]]:
    """(the prompt with its tags cut out, the refs of the adapters they name, in order)."""
    _refuse_tags(negative_prompt, "the negative prompt", "A1111 applies the adapters of the prompt only "
                "and sends these to the text encoder as words: move it to the prompt, or take it out")
    loras = [_adapter(match) for match in TAG.finditer(prompt)]
    return TAG.sub("", prompt), loras


def _refuse_tags(text: str | None, where: str, fix: str) -> None:
    """BadRequest naming the first tag in `text`, if there is one."""
    match = TAG.search(text or "")
    if match:
        raise BadRequest(f"{where} holds the tag {_shown(match)!r}: {fix}")


def _adapter(match: re.Match) -> AdapterRef:
    kind, tag = match.group(1), _shown(match)
    if kind not in ADAPTER_KINDS:
        raise BadRequest(f"the prompt's tag {tag!r} is an A1111 extra network this server does not apply: only "
                         "<lora:NAME:WEIGHT> and <lyco:NAME:WEIGHT> name adapters; take the tag out")
    positional, keyword = _arguments(match.group(2), tag)
    if not positional or not positional[0].strip():
        raise BadRequest(f"the prompt's tag {tag!r} names no adapter: write <lora:NAME:WEIGHT>")
    weights = [_number(text, tag) for text in positional[1:3]]
    text_encoder = keyword.pop("te", weights[0] if weights else 1.0)
    unet = keyword.pop("unet", weights[1] if len(weights) > 1 else text_encoder)
    if len(positional) > 3 or keyword:
        extra = "a rank to cut the adapter to (dyn)" if len(positional) > 3 or "dyn" in keyword else \
            f"the argument {next(iter(keyword))}="
        raise BadRequest(f"the prompt's tag {tag!r} gives {extra}, which this server does not apply: write "
                         "<lora:NAME:WEIGHT>")
    adapter = adapter_with_weight(positional[0], text_encoder)  # (a weight out of range: refused here)
    if unet != text_encoder:
        raise BadRequest(f"the prompt's tag {tag!r} gives the text encoder and the denoiser different weights "
                         f"({text_encoder:g} and {unet:g}); an adapter takes one weight here: write "
                         "<lora:NAME:WEIGHT>")
    return adapter


def _arguments(text: str, tag: str) -> tuple[list[str], dict[str, float | str]]:
    """A1111's `ExtraNetworkParams`: the arguments split at `:`; one holding exactly one `=` is
    named (`te=0.5`), the rest positional. Named weights are numbers."""
    items = text.split(":")
    reference = _reference_id(items)
    positional: list[str] = [reference] if reference else []
    keyword: dict[str, float | str] = {}
    for item in items[2:] if reference else items:
        parts = item.split("=", 2)
        if len(parts) == 2:
            keyword[parts[0]] = _number(parts[1], tag) if parts[0] in ("te", "unet") else parts[1]
        else:
            positional.append(item)
    return positional, keyword


def _reference_id(items: list[str]) -> str | None:
    """The first two arguments joined, when together they are the id of a file elsewhere
    (`civitai:MODEL@VERSION`, `url:<32 hex>`, `s3:bucket/key`, a key's `=` included): split
    at its own colon, it would be an adapter `civitai` of weight `1@2`. An adapter of the
    folder named `url` (or `s3`, `civitai`) with a weight stays what it is: `url:0.5` is no id."""
    joined = ":".join(items[:2])
    if len(items) > 1 and any(rule.match(joined) for rule in (CIVITAI, URL_ID, S3)):
        return joined
    return None


def _number(text: str, tag: str) -> float:
    if not NUMBER.fullmatch(text.strip()):
        raise BadRequest(f"the prompt's tag {tag!r}: the weight {text!r} is not a number (ASCII digits)")
    return float(text)


def _shown(match: re.Match) -> str:
    """The tag as written, cut short: a prompt may be long."""
    text = match.group(0)
    return text if len(text) <= 80 else text[:77] + "..."
