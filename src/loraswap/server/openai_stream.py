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
model has none). An error after the stream began is `event: error` with OpenAI's error body, which
openai-python raises as an `APIError` with its message. The machinery is `streaming.py`'s.
"""

import base64
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine.step_listener import spread_steps
from .generation import encode
from .image_output import record_for
from .requests import ParsedRequest
from .schemas import OpenAIEditRequest
from .streaming import (
    KEEP_ALIVE,
    StreamFeed,
    error_event,
    job_events,
    picture_file,
    sse,
    start_job,
    streaming_response,
)

# the media type `generation.encode` answers -> OpenAI's output_format
OUTPUT_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/webp": "webp"}
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
            "total_tokens": 0}


def openai_stream_asked(parsed: ParsedRequest) -> bool:
    return bool(getattr(parsed.body, "stream", False))


async def stream_openai(request: Request, route: str, parsed: ParsedRequest) -> StreamingResponse:
    """The images API's answer as events (the module's docstring)."""
    body = parsed.body
    kind = "image_edit" if isinstance(body, OpenAIEditRequest) else "image_generation"
    count = body.partial_images or 0
    gens = parsed.per_image()

    def feed() -> StreamFeed:
        return StreamFeed(partial(spread_steps, count) if count else None, bool(body.preview_full))

    first = feed()
    task = await start_job(request, route, gens[0], parsed.model, first)

    async def events() -> AsyncIterator[bytes]:
        job, job_feed = task, first
        try:
            for index, gen in enumerate(gens):
                if index:  # the next image, queued once the one before is answered
                    try:
                        job_feed = feed()
                        job = await start_job(request, route, gen, parsed.model, job_feed)
                    except Exception as e:
                        yield error_event(request, e)
                        return
                async for event in _image_events(request, parsed, kind, gen, job, job_feed):
                    yield event
                if job.cancelled() or job.exception() is not None:
                    return
        finally:
            job.cancel()  # the stream ended first (the client left): the request with it; else nothing

    return streaming_response(events())


async def _image_events(request: Request, parsed: ParsedRequest, kind: str, gen, job, feed) -> AsyncIterator[bytes]:
    """One image's partial images, then its completed event (or the error)."""
    accept, quality = parsed.output.accept("image/png"), parsed.output.quality
    shown = {"background": "opaque", "quality": "auto"}
    index = 0
    try:
        async for event in job_events(feed, job):
            if event is None:
                yield KEEP_ALIVE
            elif event[0] == "preview":
                picture = event[4]
                b64, media = await picture_file(picture, accept, quality)
                size = picture.size or tuple(picture.pixels.shape[:0:-1])
                yield _event(f"{kind}.partial_image", b64, media, size, shown, partial_image_index=index)
                index += 1
    finally:
        job.cancel()  # the stream ended first (the client left): the request with it; else nothing
    if job.cancelled():
        return
    if job.exception() is not None:
        yield error_event(request, job.exception())
        return
    result = job.result()
    record = await record_for(request, parsed.output, gen, result)
    file, media = await encode(result.image, accept, record=record, quality=quality)
    yield _event(f"{kind}.completed", base64.b64encode(file).decode(), media, result.image.size, shown,
                 usage=NO_USAGE)


def _event(kind: str, b64: str, media: str, size: tuple[int, int], shown: dict, **fields) -> bytes:
    return sse(kind, {"type": kind, "b64_json": b64, "created_at": int(time.time()), "size": f"{size[0]}x{size[1]}",
                      "output_format": OUTPUT_FORMATS[media], **shown, **fields})
