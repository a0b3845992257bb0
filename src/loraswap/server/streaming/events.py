"""A generation answered as server-sent events: its place in the queue, each step, pictures of
its steps at the interval the client asks, then the image, or the error.

The Hugging Face routes (`POST /`, `/models/{id}`) stream when asked with
`Accept: text/event-stream` or `parameters.stream`:

    : started                                                (a comment, at once)
    event: queued    data: {"position": 0}                  (requests ahead of it; again as it moves)
    event: progress  data: {"step": 3, "total": 20, "elapsed": 0.41}
    event: preview   data: {"step": 4, "total": 20, "elapsed": 0.52, "image": "<base64>", "content_type": ...}
    event: image     data: {"image": "<base64>", "content_type": "image/jpeg", "seed": 5, "compute_time": ...}
    event: error     data: {"error": "..."}

(`preview` every `parameters.preview_every` steps, at most `MAX_FULL_PREVIEWS` an image when the
VAE decodes them). OpenAI's images API streams with `stream: true`, in OpenAI's shapes
(`streaming/openai.py`). Either way:
- the response starts once the request waits for the GPU with its adapters read, or has begun,
  or after `START_WAIT_S` of neither (a long adapter read: the client sees bytes); a request
  refused before (an unknown adapter, a size, a full queue) is answered with its status, as
  without streaming; an error after is an `error` event with the JSON error body;
- the image is bitwise the one the request gets without streaming (the same seed, the same
  encoder); pictures are made only for a request that asks for them (`engine/previews.py`);
- events wait for a slow client no further than the latest step and `PENDING_PICTURES`
  pictures (`streaming/feed.py`); a client that reads nothing for `SEND_STALL_S` is dropped, and
  the decoded input images are given back to the decode budget as soon as the image is made;
- a client that leaves cancels its request (out of the queue, or stopped at its next step).
"""

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from loraswap.engine.calls import Stopped
from loraswap.engine.previews import Preview
from loraswap.engine.step_listener import every_steps
from loraswap.errors import BadRequest, LoraswapError
from loraswap.media.images import encode_image
from loraswap.server.auth import key_owner
from loraswap.server.backend import ClientGone
from loraswap.server.error_bodies import error_body, error_code, route_path
from loraswap.server.generation import IMAGE_FORMATS, encode, run_generation, server_timing, step_cache_headers
from loraswap.server.images.output import record_for
from loraswap.server.requests.decode_budget import release_decoded_now
from loraswap.server.requests.parse import ParsedRequest
from loraswap.server.streaming.feed import FeedEvent, StreamFeed

logger = logging.getLogger("loraswap.server")

EVENT_STREAM = "text/event-stream"
EVENT_INTERVAL_S = 0.05  # events sent at most this often: the event loop's work stays off the GPU's way
KEEP_ALIVE_S = 15.0  # a comment line after this long without an event (proxies close quiet connections)
START_WAIT_S = 10.0  # the response starts after this long without the job's first event, whatever comes
SEND_STALL_S = 60.0  # a client that takes nothing for this long is dropped (its request with it)
MAX_FULL_PREVIEWS = 8  # VAE-decoded previews an image may ask for: each costs a decode on the GPU
INLINE_PIXELS = 64 * 64  # a picture this small is encoded on the event loop (less work than a thread's hand-over)
STARTED = b": started\n\n"  # an SSE comment (clients skip it): bytes at once, for proxies that wait for them
KEEP_ALIVE = b": keep-alive\n\n"
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # nginx: pass each event on at once


def sse(event: str, data: dict) -> bytes:
    """One server-sent event: its name and its data as one line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def start_job(request: Request, route: str, gen, model: str | None, feed: StreamFeed) -> asyncio.Task:
    """The generation started as a task, once it waits for the GPU or has begun (its first
    event), has ended, or `START_WAIT_S` passed; a request refused before raises its error here,
    to be answered with its status as without streaming."""
    task = asyncio.create_task(run_generation(request.app.state, route, gen, model, request.is_disconnected,
                                              on_step=feed, owner=key_owner(request)))
    task.add_done_callback(lambda _: feed.wake_soon())
    deadline = time.monotonic() + START_WAIT_S
    try:
        while not task.done() and not feed.has_events() and (left := deadline - time.monotonic()) > 0:
            await feed.changed(left)
    except BaseException:
        task.cancel()
        raise
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()
    return task


async def job_events(feed: StreamFeed, task: asyncio.Task) -> AsyncIterator[FeedEvent | None]:
    """The job's events as they come, at most one batch every `EVENT_INTERVAL_S` (the steps
    between are one event: the latest), and None after a while without any; until its task has
    ended, which is seen at once. The task is cancelled (its request with it) if the stream ends
    first (the client left)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            sent = loop.time()
            for event in feed.take():
                yield event
            if task.done():
                return
            if not await feed.changed(KEEP_ALIVE_S):
                yield None
                continue
            pause = EVENT_INTERVAL_S - (loop.time() - sent)
            if pause > 0:
                await asyncio.wait([task], timeout=pause)
    finally:
        if not task.done():
            task.cancel()


async def picture_file(picture: Preview, accept: str, quality: int | None = None) -> tuple[str, str] | None:
    """A picture encoded as the image will be, without its record: (base64, media type); None
    when it could not be (logged: the stream goes on without it). Off the event loop, in one go
    (it may wait for its copy from the GPU)."""
    media, fmt = next(((m, f) for m, f in IMAGE_FORMATS if m in accept), ("image/jpeg", "JPEG"))

    def encoded() -> str:
        return base64.b64encode(encode_image(picture.image(), fmt, quality=quality)).decode()

    width, height = picture.size
    try:
        if picture.ready is None and width * height <= INLINE_PIXELS:
            return encoded(), media
        return await run_in_threadpool(encoded), media
    except Exception:
        logger.warning("a preview could not be encoded: skipped", exc_info=True)
        return None


def client_left(error: BaseException) -> bool:
    """Whether `error` only says that nobody waits for the answer any more."""
    return isinstance(error, ClientGone | Stopped | asyncio.CancelledError)


def error_event(request: Request, error: BaseException) -> bytes | None:
    """The `error` event of a failure after the stream began, in the route's error shape (the
    request then counts as failed: `requests.hold_named_urls`); None for a client that left."""
    if client_left(error):
        return None
    request.state.stream_failed = True
    if isinstance(error, LoraswapError):
        body = error_body(route_path(request.scope), error.status, error.message, code=error_code(error))
    else:
        logger.error("a streamed request failed", exc_info=error)
        body = error_body(route_path(request.scope), 500, "internal server error")
    return sse("error", body)


async def guarded(request: Request, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`events` after the `STARTED` comment; a failure among them (encoding the image, say) ends
    the stream with its error event rather than cutting it."""
    yield STARTED
    try:
        async for event in events:
            yield event
    except Exception as e:
        if (failed := error_event(request, e)) is not None:
            yield failed
    finally:
        await events.aclose()  # a client gone: the job's own clean-up (its request cancelled) runs now


async def last_event(request: Request, task: asyncio.Task,
                     answer: Callable[[object], Awaitable[bytes]]) -> AsyncIterator[bytes]:
    """A stream's last event once its job has ended: `answer(result)` (the image), its error
    event, or nothing for a job cancelled (its client left)."""
    if task.cancelled():
        return
    if task.exception() is not None:
        if (failed := error_event(request, task.exception())) is not None:
            yield failed
        return
    yield await answer(task.result())


async def job_ended(request: Request) -> None:
    """The job's image is made (or it failed): the decoded inputs go back to the budget now,
    not once a slow client has read the last event."""
    await release_decoded_now(request)


class EventStream(StreamingResponse):
    """Server-sent events, each send given `SEND_STALL_S` at most: a client that stops reading
    holds its request's memory no longer (the server itself has no write timeout)."""

    def __init__(self, request: Request, events: AsyncIterator[bytes]):
        super().__init__(guarded(request, events), media_type=EVENT_STREAM, headers=STREAM_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        async def send_in_time(message) -> None:
            with anyio.fail_after(SEND_STALL_S):
                await send(message)

        try:
            await super().__call__(scope, receive, send_in_time)
        except TimeoutError:
            logger.info("a streaming client read nothing for %.0f s: dropped", SEND_STALL_S)
        finally:
            with contextlib.suppress(RuntimeError):  # already ended, or ending
                await self.body_iterator.aclose()  # its request cancelled, if it still runs


# ---------------------------------------------------------------- the Hugging Face routes
def hf_stream_asked(request: Request, parsed: ParsedRequest) -> bool:
    """`parameters.stream`, else an `Accept` that names `text/event-stream`; BadRequest for
    preview options the request could not have (without a stream, or too many full previews)."""
    parameters = parsed.body.parameters
    stream = parameters.stream if parameters.stream is not None else EVENT_STREAM in request.headers.get("accept", "")
    asked = [name for name in ("preview_every", "preview_full") if getattr(parameters, name) is not None]
    if asked and not stream:
        raise BadRequest(f"parameters.{asked[0]} is for a streamed answer: ask for one with "
                         "Accept: text/event-stream or parameters.stream true")
    if stream:
        check_previews(parameters.preview_every, bool(parameters.preview_full), parameters.num_inference_steps,
                       request.app.state.config.max_steps)
    return stream


def check_previews(every: int | None, full: bool, steps: int | None, max_steps: int) -> None:
    """BadRequest naming the field for preview options out of bounds: an interval past the
    server's steps, full previews without an interval, or more than `MAX_FULL_PREVIEWS` of them
    (counted at the steps asked, else at the server's most)."""
    if every is not None and every > max_steps:
        raise BadRequest(f"parameters.preview_every {every} must be between 1 and {max_steps}")
    if full and every is None:
        raise BadRequest("parameters.preview_full needs parameters.preview_every (how often)")
    count = ((steps or max_steps) - 1) // every if full else 0
    if count > MAX_FULL_PREVIEWS:
        raise BadRequest(f"parameters.preview_every {every} with preview_full asks for {count} full previews "
                         f"({steps or f'up to {max_steps}'} steps); at most {MAX_FULL_PREVIEWS}: preview every "
                         f"{-(-((steps or max_steps) - 1) // MAX_FULL_PREVIEWS)} steps or more, or give "
                         "num_inference_steps")


async def stream_hf(request: Request, route: str, parsed: ParsedRequest, started: float) -> StreamingResponse:
    """The HF routes' answer as events (the module's docstring)."""
    parameters = parsed.body.parameters
    every = parameters.preview_every or 0
    feed = StreamFeed((lambda done, total: every_steps(every, done, total)) if every else None,
                      bool(parameters.preview_full))
    parsed_at = time.perf_counter()
    task = await start_job(request, route, parsed.engine_request, parsed.model, feed)
    accept = parsed.output.accept(request.headers.get("accept", ""))
    # what the last event needs, without the decoded inputs (they go with the job)
    image_answer = _hf_image_answer(request, parsed, accept, parsed_at - started)

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in job_events(feed, task):
                if (sent := KEEP_ALIVE if event is None else await _hf_event(event, accept)) is not None:
                    yield sent
        finally:
            task.cancel()  # the stream ended first (the client left): the request with it; else nothing
            await job_ended(request)
        async for event in last_event(request, task, image_answer):
            yield event

    return EventStream(request, events())


async def _hf_event(event: FeedEvent, accept: str) -> bytes | None:
    if event.kind == "queued":
        return sse("queued", {"position": event.ahead})
    numbers = {"step": event.step, "total": event.total, "elapsed": round(event.elapsed, 4)}
    if event.kind == "progress":
        return sse("progress", numbers)
    encoded = await picture_file(event.picture, accept)
    return None if encoded is None else sse("preview", {**numbers, "image": encoded[0], "content_type": encoded[1]})


def _hf_image_answer(request: Request, parsed: ParsedRequest, accept: str,
                     parse_seconds: float) -> Callable:
    """The last event's maker: the image, encoded as without streaming, with the numbers of its
    headers. It keeps the request's record fields, not its input images."""
    output, gen = parsed.output, without_inputs(parsed.engine_request)

    async def image_event(result) -> bytes:
        encoding = time.perf_counter()
        record = await record_for(request, output, gen, result)
        data, media = await encode(result.image, accept, record=record)
        skipped = step_cache_headers([result]).get("x-steps-skipped")
        return sse("image", {
            "image": base64.b64encode(data).decode(), "content_type": media, "seed": result.seed,
            "compute_time": round(result.swap_seconds + result.generate_seconds, 4),
            "swap_ms": round(result.swap_seconds * 1e3, 2),
            "server_timing": server_timing(result, parse=parse_seconds, encode=time.perf_counter() - encoding),
            **({"steps_skipped": int(skipped)} if skipped else {})})

    return image_event


def without_inputs(gen):
    """`gen` without its decoded input image and mask (its record needs neither)."""
    return gen.model_copy(update={"image": None, "mask": None}) if gen.image is not None or gen.mask is not None \
        else gen
