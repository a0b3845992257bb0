"""OpenAI's images API answered as server-sent events (`stream: true`), in OpenAI's shapes, which
openai-python reads as `ImageGenStreamEvent` (generations) and `ImageEditStreamEvent` (edits):

    event: image_generation.partial_image
    data: {"type": "image_generation.partial_image", "b64_json": ..., "partial_image_index": 0,
           "created_at": ..., "size": "1024x1024", "output_format": "png", "background": "opaque",
           "quality": "auto"}
    event: image_generation.completed
    data: {"type": "image_generation.completed", "b64_json": ..., ..., "usage": {...}}

(`image_edit.partial_image` and `image_edit.completed` for edits). `partial_images` (0 to 3)
pictures come spread over the steps, each a sketch of the latents (`preview_full: true`, an
extension: the VAE's), fewer when the image has too few steps, as OpenAI allows; with `n` images,
each has its partial images and then its `completed` event, in turn. The completed image is
bitwise the `b64_json` of the same request without streaming; usage counts no tokens (a diffusion
model has none). OpenAI streams images as `b64_json` only: `response_format: "url"` with
`stream: true` is refused (400). An error after the stream began is `event: error` with OpenAI's
error body, which openai-python raises as an `APIError` with its message. The machinery is
`streaming.py`'s.
"""

import base64
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from loraswap.engine.step_listener import spread_steps
from loraswap.errors import BadRequest
from loraswap.server.generation import encode
from loraswap.server.images.output import record_for
from loraswap.server.requests.parse import ParsedRequest
from loraswap.server.requests.schemas import OpenAIEditRequest
from loraswap.server.streaming.events import (
    KEEP_ALIVE,
    EventStream,
    error_event,
    job_ended,
    job_events,
    last_event,
    picture_file,
    sse,
    start_job,
    without_inputs,
)
from loraswap.server.streaming.feed import StreamFeed

# the media type `generation.encode` answers -> OpenAI's output_format
OUTPUT_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/webp": "webp"}
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}
SHOWN = {"background": "opaque", "quality": "auto"}


def openai_stream_asked(parsed: ParsedRequest) -> bool:
    """`stream: true`; BadRequest for options a stream cannot answer, or that need one."""
    body = parsed.body
    stream = bool(getattr(body, "stream", False))
    if stream and parsed.response_format == "url":
        raise BadRequest("stream: true answers each image as b64_json, as OpenAI's stream does: "
                         "drop response_format \"url\", or stream false")
    if not stream and getattr(body, "preview_full", None) is not None:
        raise BadRequest("preview_full is for a streamed answer: ask for one with stream: true")
    return stream


async def stream_openai(request: Request, route: str, parsed: ParsedRequest) -> StreamingResponse:
    """The images API's answer as events (the module's docstring)."""
    body = parsed.body
    kind = "image_edit" if isinstance(body, OpenAIEditRequest) else "image_generation"
    count, full = body.partial_images or 0, bool(body.preview_full)
    gens, output, model = parsed.per_image(), parsed.output, parsed.model

    def feed() -> StreamFeed:
        return StreamFeed(partial(spread_steps, count) if count else None, full)

    first = feed()
    task = await start_job(request, route, gens[0], model, first)

    async def events() -> AsyncIterator[bytes]:
        job, job_feed = task, first
        try:
            for index in range(len(gens)):
                gen, gens[index] = gens[index], without_inputs(gens[index])  # the inputs go with the last job
                if index:  # the next image, queued once the one before is answered
                    try:
                        job_feed = feed()
                        job = await start_job(request, route, gen, model, job_feed)
                    except Exception as e:
                        if (failed := error_event(request, e)) is not None:
                            yield failed
                        return
                del gen
                async for event in _image_events(request, output, kind, gens[index], job, job_feed,
                                                 last=index == len(gens) - 1):
                    yield event
                if job.cancelled() or job.exception() is not None:
                    return
        finally:
            job.cancel()  # the stream ended first (the client left): the request with it; else nothing
            await job_ended(request)

    return EventStream(request, events())


async def _image_events(request: Request, output, kind: str, gen, job, feed, last: bool) -> AsyncIterator[bytes]:
    """One image's partial images, then its completed event (or the error)."""
    accept, quality = output.accept("image/png"), output.quality
    index = 0
    try:
        async for event in job_events(feed, job):
            if event is None:
                yield KEEP_ALIVE
            elif event.kind == "preview" and (encoded := await picture_file(event.picture, accept, quality)):
                yield _event(f"{kind}.partial_image", *encoded, event.picture.size, partial_image_index=index)
                index += 1
    finally:
        job.cancel()  # the stream ended first (the client left): the request with it; else nothing
        if last or job.cancelled() or job.exception() is not None:
            await job_ended(request)  # no image follows: the decoded inputs go back now

    async def completed(result) -> bytes:
        record = await record_for(request, output, gen, result)
        file, media = await encode(result.image, accept, record=record, quality=quality)
        return _event(f"{kind}.completed", base64.b64encode(file).decode(), media, result.image.size, usage=NO_USAGE)

    async for event in last_event(request, job, completed):
        yield event


def _event(kind: str, b64: str, media: str, size: tuple[int, int], **fields) -> bytes:
    return sse(kind, {"type": kind, "b64_json": b64, "created_at": int(time.time()), "size": f"{size[0]}x{size[1]}",
                      "output_format": OUTPUT_FORMATS[media], **SHOWN, **fields})
