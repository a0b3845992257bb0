"""A generation answered as server-sent events: its place in the queue, each step, pictures of
its steps at the interval the client asks, then the image, or the error.

The Hugging Face routes (`POST /`, `/models/{id}`) stream when asked with
`Accept: text/event-stream` or `parameters.stream`:

    event: queued    data: {"position": 0}                  (requests ahead of it; again as it moves)
    event: progress  data: {"step": 3, "total": 20, "elapsed": 0.41}
    event: preview   data: {"step": 4, "total": 20, "elapsed": 0.52, "image": "<base64>", "content_type": ...}
    event: image     data: {"image": "<base64>", "content_type": "image/jpeg", "seed": 5, "compute_time": ...}
    event: error     data: {"error": "..."}

(`preview` every `parameters.preview_every` steps). OpenAI's images API streams with `stream: true`,
in OpenAI's shapes (`openai_stream.py`). Either way:
- the response starts once the request waits for the GPU with its adapters read, or has begun:
  a request refused before (an unknown adapter, a size, a full queue) is answered with its status,
  as without streaming; an error after is an `error` event with the JSON error body;
- the image is bitwise the one the request gets without streaming (the same seed, the same
  encoder); pictures are made only for a request that asks for them (`engine/previews.py`);
- events wait for a slow client no further than the latest step and `PENDING_PICTURES`
  pictures (older pictures are dropped), so memory stays bounded whatever the client reads;
- a client that leaves cancels its request (out of the queue, or stopped at its next step).
"""

import asyncio
import base64
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from ..engine.previews import Preview
from ..engine.step_listener import StepListener, every_steps
from ..errors import LoraswapError
from ..media.images import encode_image
from .auth import url_owner
from .error_bodies import error_body, error_code, route_path
from .generation import IMAGE_FORMATS, encode, run_generation, server_timing, step_cache_headers
from .image_output import record_for
from .requests import ParsedRequest

logger = logging.getLogger("loraswap.server")

EVENT_STREAM = "text/event-stream"
PENDING_PICTURES = 2  # pictures a slow client may have waiting; older ones are dropped
EVENT_INTERVAL_S = 0.05  # events sent at most this often: the event loop's work stays off the GPU's way
KEEP_ALIVE_S = 15.0  # a comment line after this long without an event (proxies close quiet connections)
INLINE_PIXELS = 64 * 64  # a picture this small is encoded on the event loop (a tenth of a millisecond)
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # nginx: pass each event on at once


def sse(event: str, data: dict) -> bytes:
    """One server-sent event: its name and its data as one line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class StreamFeed(StepListener):
    """The events of one job, from the worker's thread to the event loop: the latest step, the
    place in the queue, and at most `PENDING_PICTURES` pictures not yet sent."""

    def __init__(self, wants_preview: Callable[[int, int], bool] | None = None, full: bool = False):
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._lock = threading.Lock()
        self._events: deque[tuple] = deque()  # ("queued", ahead) | ("progress", ...) | ("preview", ..., Preview)
        self._woken = False  # a wake-up is on its way to the reader: the next events need none
        self._wants = wants_preview
        self.asks_previews, self.preview_full = wants_preview is not None, full
        self.started = time.monotonic()

    # ------------------------------------------------ the worker's thread
    def __call__(self, done: int, total: int) -> None:
        self._push(("progress", done, total, time.monotonic() - self.started))

    def queued(self, ahead: int) -> None:
        self._push(("queued", ahead))

    def wants_preview(self, done: int, total: int) -> bool:
        return self._wants is not None and self._wants(done, total)

    def preview(self, done: int, total: int, picture: Preview) -> None:
        self._push(("preview", done, total, time.monotonic() - self.started, picture))

    def _push(self, event: tuple) -> None:
        with self._lock:
            if event[0] != "preview" and self._events and self._events[-1][0] == event[0]:
                self._events[-1] = event  # a newer step (or place) stands for the one not yet sent
            else:
                self._events.append(event)
            pictures = [e for e in self._events if e[0] == "preview"]
            if len(pictures) > PENDING_PICTURES:
                self._events.remove(pictures[0])
            woken, self._woken = self._woken, True
        if not woken:
            self.wake_soon()

    def wake_soon(self) -> None:
        """Wake the event loop's reader (from any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._changed.set)
        except RuntimeError:  # the loop has closed: nobody reads
            pass

    # ------------------------------------------------ the event loop
    def take(self) -> list[tuple]:
        with self._lock:
            events, self._events, self._woken = list(self._events), deque(), False
        return events

    async def changed(self, timeout: float) -> bool:
        """Wait until an event is pushed (or `wake_soon`); False after `timeout` seconds of none."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        self._changed.clear()
        return True

    def has_events(self) -> bool:
        with self._lock:
            return bool(self._events)


async def start_job(request: Request, route: str, gen, model: str | None, feed: StreamFeed) -> asyncio.Task:
    """The generation started as a task, once it waits for the GPU or has begun (its first
    event), or has ended; a request refused before raises its error here, to be answered with
    its status as without streaming."""
    task = asyncio.create_task(run_generation(request.app.state, route, gen, model, request.is_disconnected,
                                              on_step=feed, owner=url_owner(request)))
    task.add_done_callback(lambda _: feed.wake_soon())
    try:
        while not task.done() and not feed.has_events():
            await feed.changed(KEEP_ALIVE_S)
    except BaseException:
        task.cancel()
        raise
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()
    return task


async def job_events(feed: StreamFeed, task: asyncio.Task) -> AsyncIterator[tuple | None]:
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


async def picture_file(picture: Preview, accept: str, quality: int | None = None) -> tuple[str, str]:
    """A picture encoded as the image will be, without its record: (base64, media type). Off the
    event loop, in one go (it may wait for its copy from the GPU)."""
    media, fmt = next(((m, f) for m, f in IMAGE_FORMATS if m in accept), ("image/jpeg", "JPEG"))

    def encoded() -> str:
        return base64.b64encode(encode_image(picture.image(), fmt, quality=quality)).decode()

    width, height = picture.size or picture.pixels.shape[:0:-1]
    if picture.ready is None and width * height <= INLINE_PIXELS:  # less work than a thread's hand-over
        return encoded(), media
    return await run_in_threadpool(encoded), media


def error_event(request: Request, error: BaseException) -> bytes:
    """The `error` event of a failure after the stream began, in the route's error shape."""
    if isinstance(error, LoraswapError):
        body = error_body(route_path(request.scope), error.status, error.message, code=error_code(error))
    else:
        logger.error("a streamed request failed", exc_info=error)
        body = error_body(route_path(request.scope), 500, "internal server error")
    return sse("error", body)


def streaming_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type=EVENT_STREAM, headers=STREAM_HEADERS)


# ---------------------------------------------------------------- the Hugging Face routes
def hf_stream_asked(request: Request, parsed: ParsedRequest) -> bool:
    """`parameters.stream`, else an `Accept` that names `text/event-stream`."""
    stream = parsed.body.parameters.stream
    return stream if stream is not None else EVENT_STREAM in request.headers.get("accept", "")


async def stream_hf(request: Request, route: str, parsed: ParsedRequest, started: float) -> StreamingResponse:
    """The HF routes' answer as events (the module's docstring)."""
    parameters = parsed.body.parameters
    every = parameters.preview_every or 0
    feed = StreamFeed((lambda done, total: every_steps(every, done, total)) if every else None,
                      bool(parameters.preview_full))
    parsed_at = time.perf_counter()
    task = await start_job(request, route, parsed.engine_request, parsed.model, feed)
    accept = parsed.output.accept(request.headers.get("accept", ""))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in job_events(feed, task):
                yield KEEP_ALIVE if event is None else await _hf_event(event, accept)
        finally:
            task.cancel()  # the stream ended first (the client left): the request with it; else nothing
        if task.cancelled():
            return
        if task.exception() is not None:
            yield error_event(request, task.exception())
            return
        yield await _hf_image(request, parsed, task.result(), accept, parsed_at - started)

    return streaming_response(events())


async def _hf_event(event: tuple, accept: str) -> bytes:
    if event[0] == "queued":
        return sse("queued", {"position": event[1]})
    numbers = {"step": event[1], "total": event[2], "elapsed": round(event[3], 4)}
    if event[0] == "progress":
        return sse("progress", numbers)
    image, media = await picture_file(event[4], accept)
    return sse("preview", {**numbers, "image": image, "content_type": media})


async def _hf_image(request: Request, parsed: ParsedRequest, result, accept: str, parse_seconds: float) -> bytes:
    """The last event: the image, encoded as without streaming, with the numbers of its headers."""
    encoding = time.perf_counter()
    record = await record_for(request, parsed.output, parsed.engine_request, result)
    data, media = await encode(result.image, accept, record=record)
    skipped = step_cache_headers([result]).get("x-steps-skipped")
    return sse("image", {
        "image": base64.b64encode(data).decode(), "content_type": media, "seed": result.seed,
        "compute_time": round(result.swap_seconds + result.generate_seconds, 4),
        "swap_ms": round(result.swap_seconds * 1e3, 2),
        "server_timing": server_timing(result, parse=parse_seconds, encode=time.perf_counter() - encoding),
        **({"steps_skipped": int(skipped)} if skipped else {})})
