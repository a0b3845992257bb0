"""One request type for every generation route: the engine's `GenerateRequest` plus the model
the route names, parsed from a Hugging Face JSON body, an OpenAI JSON body or an OpenAI edits
form by one function (`parse_request`).
"""

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from PIL import Image
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from loraswap.adapters.naming.prompt_tags import take_adapter_tags
from loraswap.adapters.naming.specs import adapter_with_weight, parse_adapter_specs
from loraswap.adapters.reference import AdapterRef
from loraswap.engine.request import GenerateRequest
from loraswap.engine.step_cache import canonical
from loraswap.errors import BadRequest
from loraswap.media.images import (
    ImageLimits,
    MaskConvention,
    decode_base64,
    decode_cost,
    looks_like_image,
    output_size,
    read_inputs,
    require_image,
)
from loraswap.server.auth import key_owner
from loraswap.server.backend import Backend
from loraswap.server.config import ServerConfig
from loraswap.server.images.output import ImageOutput
from loraswap.server.requests.decode_budget import DecodeBudget, decoded_bytes
from loraswap.server.requests.limits import check_limits, image_limits
from loraswap.server.requests.schemas import ApiBody, invalid_request_message, parse_size
from loraswap.server.url_book import NamedUrls, scoped_refs
from loraswap.tracing import traced


@dataclass(frozen=True)
class ParsedRequest:
    """What a generation route asked for, whichever API (images or videos): the engine's
    request, the hosted base model the route names (None: the one the adapters route to), how
    many images (OpenAI `n`) and a video's frame rate, when the request gives one; how OpenAI's
    images are answered (`response_format`: `b64_json`, or `url`)."""

    engine_request: GenerateRequest
    model: str | None = None
    count: int = 1
    fps: int | None = None
    response_format: str = "b64_json"
    body: ApiBody | None = None  # the typed body, for a route that answers with more of it (A1111's echo)
    output: ImageOutput = ImageOutput()  # the images' format, quality and record (`images/output.py`)

    def per_image(self) -> list[GenerateRequest]:
        """One request per image; with a seed, image i gets seed + i (checked at parse)."""
        seed = self.engine_request.seed
        if self.count == 1:
            return [self.engine_request]
        return [self.engine_request.model_copy(update={"seed": None if seed is None else seed + i})
                for i in range(self.count)]


async def read_body(request: Request, max_bytes: int, limit_words: str) -> bytes:
    """The body, refused (400) past `max_bytes` before it is read when the client declares its
    length, and as soon as it passes `max_bytes` otherwise (a chunked body)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(f"the body is {declared} bytes; the limit is {limit_words}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"the body is over {max_bytes} bytes; the limit is {limit_words}")
        chunks.append(chunk)
    return b"".join(chunks)


MAX_JSON_NESTING = 64  # arrays and objects in one another; a real body nests 4 or 5


def json_nesting(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (0 for a scalar), without
    recursion: one pass over its containers."""
    if not isinstance(value, dict | list):
        return 0
    deepest, stack = 1, [(value, 1)]  # containers only: a body of a million numbers stacks none
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        items = value.values() if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, dict | list))
    return deepest


def parse_json(body: bytes, api: type[ApiBody], max_bytes: int):
    """The body as JSON; a body over `max_bytes` that is not JSON is refused for its size, as
    it would be without images."""
    try:
        value = json.loads(body)
    except RecursionError:  # json's own limit: the interpreter's, which torch.compile raises
        raise _nested_too_deep(api) from None
    except ValueError:  # not JSON, not UTF-8, or an integer of thousands of digits
        if api.takes_images and looks_like_image(body):
            raise BadRequest(f"the body is a bare image file, with no prompt: send JSON: {api.example}") from None
        if len(body) > max_bytes:
            raise BadRequest(f"the body is {len(body)} bytes; the limit is {max_bytes}") from None
        raise BadRequest(f"the body must be JSON: {api.example}") from None
    if json_nesting(value) > MAX_JSON_NESTING:  # (under the recursion limit torch.compile raised)
        raise _nested_too_deep(api)
    return value


def _nested_too_deep(api: type[ApiBody]) -> BadRequest:
    return BadRequest(f"the body's JSON is nested too deep: {api.example}")


class Utf8FormParser(MultiPartParser):
    """Starlette's multipart parser, but a text field that is not UTF-8 is refused (its parser
    reads it as Latin-1 instead), whatever charset the request declares."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None:
            return super().on_part_end()
        try:
            text = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise MultiPartException(f"the field {part.field_name!r} is not UTF-8 text") from None
        self.items.append((part.field_name, text))


async def parse_form(headers, body: bytes, max_bytes: int, example: str) -> dict[str, Any]:
    """A multipart/form-data body as {name: text, or a file's bytes}; a list of files
    (`image[]`, as the openai client sends several) under its plain name."""
    if not headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadRequest(f"the body must be multipart/form-data: {example}")

    async def stream():
        yield body

    parser = Utf8FormParser(headers, stream(), max_files=4, max_fields=64, max_part_size=max_bytes)
    try:
        form = await parser.parse()
    except MultiPartException as e:
        raise BadRequest(f"the multipart body cannot be read ({e.message}): {example}") from None
    fields: dict[str, Any] = {}
    try:
        for name, value in form.multi_items():
            name = name.removesuffix("[]")
            if name in fields:
                raise BadRequest(f"the form gives {name} more than once: send one (one image per edit)")
            fields[name] = await value.read() if isinstance(value, UploadFile) else value
    finally:
        await form.close()
    return fields


async def read_request(request: Request, api: type[ApiBody], config: ServerConfig) -> ApiBody:
    """The body as the API's typed request. A body that may carry images may be larger by
    their limit (an image and a mask, base64); the rest is held to `max_body_bytes`."""
    limits = image_limits(config)
    extra = 2 * limits.max_base64_chars() if api.takes_images else 0
    words = f"{config.max_body_bytes}" + (f" besides an image and a mask of at most {limits.max_bytes} bytes "
                                          "each" if extra else "")
    body = await read_body(request, config.max_body_bytes + extra, words)
    raw = await parse_form(request.headers, body, config.max_body_bytes, api.example) if api.form \
        else parse_json(body, api, config.max_body_bytes)
    parsed = api.parse(raw)
    if len(body) - parsed.image_bytes() > config.max_body_bytes:
        raise BadRequest(f"the body is {len(body)} bytes; the limit is {words}")
    return parsed


# a route's own say on the model, once the body's model and adapters are known and before any
# image is decoded: (the body, the hosted model it names or None, its adapters) -> the model
ChooseModel = Callable[[ApiBody, str | None, list[AdapterRef]], str | None]


@traced("parse")
async def parse_request(request: Request, api: type[ApiBody], path_model: str | None = None,
                        choose_model: ChooseModel | None = None) -> ParsedRequest:
    """The one parse of every generation route. `path_model`: the model id in the URL (HF
    `/models/{id}`); `choose_model`: the route's own check of the model (A1111's checkpoint)."""
    config, backend = request.app.state.config, request.app.state.backend
    # 1. the body, as the API's typed request (JSON, or a multipart form with files)
    body = await read_request(request, api, config)
    fields = body.fields()
    check_text(fields)
    named = path_model or fields.pop("model", None)
    # 2. every field within its bounds (one table: limits.LIMITS; an empty prompt is judged in 3,
    #    once its tags are cut out), and the values they give: OpenAI's size as a width and a
    #    height, the seed of the last of n images
    _check_bounds(fields, config)
    output = ImageOutput.of(fields)
    if fields.get("size"):
        fields["width"], fields["height"] = parse_size(fields["size"])
    count = fields.get("n") or 1
    last_seed = fields["seed"] + count - 1 if fields.get("seed") is not None else None
    check_limits({"width": fields.get("width"), "height": fields.get("height"), "seed": last_seed}, config)
    frames, fps = _video_frames(fields, config)
    require_image(fields.get("image") is not None, fields.get("mask") is not None, fields.get("strength"))
    # 3. the prompt's A1111 tags (`<lora:NAME:WEIGHT>`) cut out of it; the name: a hosted base
    #    model, or adapters put before those of the tags, the body's `loras` and the `lora`
    #    header, each made a checked `AdapterRef` here, once; then what the route says of the model
    tagged = _prompt_adapters(fields, config)
    _check_prompt_given(fields["prompt"], api, tagged)
    model, loras = _model_and_adapters(request, backend, named, api.names_blend, tagged, fields.get("loras") or [])
    if choose_model is not None:
        model = choose_model(body, model, loras)
    # 4. the image and the mask, decoded and checked (the costliest check, so the last);
    #    no size asked: the image's
    image, mask = await decode_inputs(request, fields.get("image"), fields.get("mask"), image_limits(config),
                                      api.mask_convention)
    size_from_image = image is not None and fields.get("width") is None and fields.get("height") is None
    if image is not None:
        fields["width"], fields["height"] = output_size(image, fields.get("width"), fields.get("height"),
                                                        config.max_width, config.max_height,
                                                        config.auto_size_max_pixels)
    # 5. the engine's request (its own checks too: the blend's are the engine's)
    try:
        engine_request = GenerateRequest(
            prompt=fields["prompt"], negative_prompt=fields.get("negative_prompt"),
            steps=fields.get("num_inference_steps"), guidance=fields.get("guidance_scale"),
            width=fields.get("width"), height=fields.get("height"), seed=fields.get("seed"),
            loras=loras, image=image, mask=mask, strength=fields.get("strength"), frames=frames, output=api.output,
            max_frames=config.max_video_frames if api.output == "video" else None,
            step_cache=canonical(fields.get("step_cache")), size_from_image=size_from_image)
    except ValidationError as e:
        raise BadRequest(invalid_request_message(e.errors())) from None
    return ParsedRequest(engine_request, model, count, fps, body=body, output=output,
                         response_format=fields.get("response_format") or "b64_json")


def check_text(value, name: str = "") -> None:
    """BadRequest naming the field whose text is not Unicode a tokenizer can read: a lone
    surrogate (JSON's `\\ud800` escape, valid JSON, no character) makes the tokenizer raise."""
    if isinstance(value, str):
        if value.isascii():  # a base64 image, most prompts: nothing to check
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"{name or 'the body'} holds {value[e.start:e.end]!a}, half of a UTF-16 pair (a lone "
                             "surrogate), which is no character: send the pair, or the character itself") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, key)
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_text(item, name)


async def decode_inputs(request: Request, image: bytes | str | None, mask: bytes | str | None, limits: ImageLimits,
                        mask_convention: MaskConvention = "openai") -> tuple[Image.Image | None, Image.Image | None]:
    """The request's image and mask (raw bytes, or base64 text; the mask read by
    `mask_convention`, `media.images.read_mask`), decoded and checked off the event loop (a
    large image takes a CPU for a while), once their cost fits the app's `DecodeBudget`; the
    request then holds what they take until it is answered."""
    require_image(image is not None, mask is not None, None)
    if image is None:
        return None, None

    def files():  # base64 too: a large image takes a CPU for a while either way
        data = _as_bytes(image, "image", limits), None if mask is None else _as_bytes(mask, "mask", limits)
        mask_cost = decode_cost(data[1], "mask", limits) if mask is not None else 0
        return data, decode_cost(data[0], "image", limits) + mask_cost

    (image_bytes, mask_bytes), cost = await run_in_threadpool(files)
    budget: DecodeBudget = request.app.state.decode_budget
    await budget.acquire(cost)
    kept = 0
    try:
        decoded = await run_in_threadpool(read_inputs, image_bytes, mask_bytes, limits, mask_convention)
        if hasattr(request.state, "decoded_bytes"):  # released once answered, by the route's `release_decoded`
            kept = min(cost, decoded_bytes(*decoded))
            request.state.decoded_bytes = kept
        return decoded
    finally:
        await budget.release(cost - kept)


def _as_bytes(value: bytes | str, what: str, limits: ImageLimits) -> bytes:
    return decode_base64(value, what, limits) if isinstance(value, str) else value


def _video_frames(fields: dict, config: ServerConfig) -> tuple[int | None, int | None]:
    """A video's frames and the fps it plays at: the frames as asked (`frames`, or diffusers'
    `num_frames`), else `seconds` at the asked fps (else the server's `video_fps`, which the
    video then plays at, so that it lasts the seconds asked); None: the model's default."""
    if fields.get("seconds") is None:
        frames = next((fields[n] for n in ("frames", "num_frames") if fields.get(n) is not None), None)
        return frames, fields.get("fps")
    fps = fields.get("fps") or config.video_fps
    frames = round(fields["seconds"] * fps)
    if not 1 <= frames <= config.max_video_frames:
        raise BadRequest(f"seconds {fields['seconds']:g} at {fps} fps is {frames} frames; a video has 1 to "
                         f"{config.max_video_frames} frames (seconds x fps)")
    return frames, fps


def _prompt_adapters(fields: dict, config: ServerConfig) -> list[AdapterRef]:
    """The adapters the prompt's A1111 tags name, the tags cut out of `fields["prompt"]`
    (`adapters/naming/prompt_tags.py`); none with --prompt-adapter-tags off (the prompt untouched)."""
    if config.prompt_adapter_tags == "off":
        return []
    fields["prompt"], tagged = take_adapter_tags(fields["prompt"], fields.get("negative_prompt"))
    return tagged


def _check_bounds(fields: dict, config: ServerConfig) -> None:
    """Every field within its bounds (`limits.check_limits`), but whether the prompt may be
    empty, which is judged once its tags are cut out (`_check_prompt_given`): a blank prompt
    (spaces at most) is held to its length alone here."""
    prompt = fields["prompt"]
    if prompt.strip():
        return check_limits(fields, config)
    check_limits({**fields, "prompt": None}, config)
    if len(prompt) > config.max_prompt_chars:
        raise BadRequest(f"the prompt has {len(prompt)} characters; the limit is {config.max_prompt_chars}")


def _check_prompt_given(prompt: str, api: type[ApiBody], tagged: list[AdapterRef]) -> None:
    """One rule for an empty prompt (or one of spaces), judged once its tags are cut out
    (`<lora:x:1>` is as empty as ""): A1111's routes take it, as A1111 does (webuiapi sends ""
    by default); the other APIs refuse it."""
    if prompt.strip() or api.takes_empty_prompt:
        return
    if tagged:
        raise BadRequest("the prompt is empty once its <lora:NAME:WEIGHT> tags are cut out: say what to draw "
                         "beside them")
    raise BadRequest("the prompt is empty")


def _model_and_adapters(request: Request, backend: Backend, named: str | None, blend: bool, tagged: list[AdapterRef],
                        listed: list[tuple[str, float]]) -> tuple[str | None, list[AdapterRef]]:
    """The hosted model `named` is, or the adapters it names (weight 1.0, or a blend when the API
    allows one); then the prompt's tags (`tagged`, refs already), the body's `loras` list, then
    the `lora` header's. An adapter named in two of them takes the later one's weight and place
    (the header's over the body's over the prompt's over the name's). The URLs they name are
    held by the request, and those of the `url:` ids they name are filled in, within the key's
    scope (`url_book.scoped_refs`)."""
    body = [adapter_with_weight(name, weight) for name, weight in listed]
    header = parse_adapter_specs(request.headers.get("lora"))
    model = named if named and backend.is_model(named) else None
    by_name = [] if model is not None or not named else \
        parse_adapter_specs(named) if blend else [adapter_with_weight(named, 1.0)]
    return model, _merged(*scoped_refs(request, named_urls(request), [by_name, tagged, body, header]))


async def hold_named_urls(request: Request) -> AsyncIterator[None]:
    """Route dependency: the URLs the request names are held until it is answered (so that their
    files can be fetched), then kept (bounded) only if it was answered with success: a refused
    request leaves nothing behind (`url_book.py`)."""
    urls = NamedUrls(request.app.state.urls, key_owner(request))
    request.state.named_urls = urls
    try:
        yield
    except BaseException:
        urls.release(accepted=False)
        raise
    # a stream answered 200 may still have ended in an error event (`streaming.error_event`)
    urls.release(accepted=not getattr(request.state, "stream_failed", False))


def named_urls(request: Request) -> NamedUrls | None:
    """The request's `NamedUrls` (`hold_named_urls`), None on a route without it."""
    return getattr(request.state, "named_urls", None)


def _merged(*groups: list[AdapterRef]) -> list[AdapterRef]:
    """The groups' adapters in order, each dropped from earlier groups when a later one names it
    (within one group a repeat stays, and the blend's check refuses it)."""
    merged: list[AdapterRef] = []
    later: set[str] = set()
    for group in reversed(groups):
        merged = [ref for ref in group if ref.adapter_id not in later] + merged
        later |= {ref.adapter_id for ref in group}
    return merged
