"""What the generation APIs do once a request is parsed: generate through the backend
(counted, timed and logged at the edge) and encode the image as the client accepts."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from loraswap.engine.engine import GenerateResult
from loraswap.engine.request import GenerateRequest
from loraswap.errors import LoraswapError, Overloaded
from loraswap.media.images import encode_image
from loraswap.media.metadata import ImageRecord
from loraswap.server.auth import key_owner
from loraswap.server.backend import ClientGone, StepCallback
from loraswap.tracing import traced

logger = logging.getLogger("loraswap.server")

# content negotiation: the media types of `media.images.OUTPUT_FORMATS`, in the order `Accept` is searched
IMAGE_FORMATS = (("image/png", "PNG"), ("image/webp", "WEBP"), ("image/jpeg", "JPEG"))
IMAGE_RESPONSES = {200: {"content": {"image/jpeg": {}, "image/png": {}, "image/webp": {}}}}


async def generate(request: Request, route: str, gen: GenerateRequest, model: str | None) -> GenerateResult:
    """One image from the backend: routed to the engine hosting the adapters' base model (or
    `model`), generated on its GPU worker; a client that leaves first cancels it."""
    return await run_generation(request.app.state, route, gen, model, request.is_disconnected,
                                owner=key_owner(request))


async def run_generation(state, route: str, gen: GenerateRequest, model: str | None,
                         is_disconnected: Callable[[], Awaitable[bool]] | None,
                         on_step: StepCallback | None = None, owner: str | None = None) -> GenerateResult:
    """`generate` for any caller, counted, timed and logged; `is_disconnected` None: nobody
    waits on it (a video job), so nothing cancels it. `on_step`: the job's progress hook (a
    `StepListener` hears more), behind the app's progress board (`progress_board.py`), where
    `owner` (its key's fingerprint, `auth.key_owner`) alone reads it."""
    started = time.perf_counter()
    status = 500
    result = None
    try:
        with state.progress.tracking(route, on_step, owner) as on_step:
            result = await state.backend.generate(gen, model, is_disconnected, on_step=on_step)
        status = 200
        return result
    except torch.OutOfMemoryError:
        status = 503
        raise Overloaded("the GPU ran out of memory for this request; retry, or ask for a smaller image") from None
    except (ClientGone, asyncio.CancelledError):  # a client that left, a video job deleted or stopped
        status = 499
        raise
    except LoraswapError as e:
        status = e.status
        raise
    finally:
        _observe(state.metrics, route, status, gen, result, time.perf_counter() - started)


def _observe(metrics, route: str, status: int, gen: GenerateRequest, result: GenerateResult | None,
             seconds: float) -> None:
    metrics.requests.labels(route, str(status)).inc()
    if result is not None:
        if result.swap_seconds:
            metrics.swap_seconds.observe(result.swap_seconds)
        metrics.generate_seconds.observe(result.generate_seconds)
        if result.step_cache is not None:
            method = result.step_cache.partition(":")[0]
            metrics.step_cache_steps.labels(method, "skipped").inc(result.steps_skipped)
            metrics.step_cache_steps.labels(method, "computed").inc(result.steps_run - result.steps_skipped)
    logger.info("%s adapters=%s swap=%.1fms generate=%.2fs total=%.2fs status=%d", route,
                ",".join(f"{ref.adapter_id}:{ref.scale:g}" for ref in gen.loras) or "-",
                result.swap_seconds * 1e3 if result else 0.0, result.generate_seconds if result else 0.0,
                seconds, status)


TIMING_PHASES = ("parse", "ray", "hold", "read", "wait", "swap", "generate", "encode")


def server_timing(result: GenerateResult, **measured: float) -> str:
    """A `Server-Timing` header (milliseconds) of where a request's time went: the phases the
    engine, worker and Ray measured (`GenerateResult.timings`), the swap and the generation,
    and what the handler measured itself (`parse`, `encode`); with a step cache, what it skipped."""
    seconds = {**result.timings, "swap": result.swap_seconds, "generate": result.generate_seconds, **measured}
    phases = [f"{phase};dur={seconds[phase] * 1e3:.1f}" for phase in TIMING_PHASES if phase in seconds]
    if result.step_cache is not None:
        phases.append(f'step-cache;desc="{result.steps_skipped} of {result.steps_run} steps skipped, '
                      f'{result.step_cache}"')
    return ", ".join(phases)


def step_cache_headers(results: list[GenerateResult]) -> dict[str, str]:
    """`x-steps-skipped`: the steps a step cache skipped, per image in order (none: no cache)."""
    if all(r.step_cache is None for r in results):
        return {}
    return {"x-steps-skipped": ",".join(str(r.steps_skipped or 0) for r in results)}


@traced("encode", lambda image, accept, *_, **__: {"loraswap.width": image.width, "loraswap.height": image.height})
async def encode(image, accept: str, *, record: ImageRecord | None = None,
                 quality: int | None = None) -> tuple[bytes, str]:
    """The image in the first format `accept` names (PNG, WebP, JPEG), else JPEG, carrying
    `record` (`images/output.py:record_for`) and at `quality` (JPEG, WebP; None: the encoder's);
    encoded off the event loop by `media.images.encode_image`."""
    media, fmt = next(((m, f) for m, f in IMAGE_FORMATS if m in accept), ("image/jpeg", "JPEG"))
    return await run_in_threadpool(_encode_with_record, image, fmt, quality, record), media


def _encode_with_record(image, fmt: str, quality: int | None, record: ImageRecord | None) -> bytes:
    """`encode_image`; a record that cannot be written is logged and left out (the image is
    made: no 5xx for a client to retry)."""
    try:
        return encode_image(image, fmt, quality=quality, record=record)
    except Exception:
        if record is None:
            raise
        logger.exception("an image goes without its record: writing it into the %s failed", fmt)
        return encode_image(image, fmt, quality=quality)
