"""The events of one streamed job, handed from the GPU worker's thread to the event loop.

A `StreamFeed` is the job's `StepListener`. It keeps what a slow reader has not yet taken in
three slots, so that memory stays bounded whatever the client reads: the latest step (a newer
one stands for the ones before), the latest place in the queue, and the last
`PENDING_PICTURES` pictures (older ones are dropped).
"""

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from loraswap.engine.previews import Preview
from loraswap.engine.step_listener import StepListener

PENDING_PICTURES = 2  # pictures a slow client may have waiting; older ones are dropped


@dataclass(frozen=True)
class FeedEvent:
    """One thing the client hears: `kind` "queued" (`ahead` requests before it), "progress"
    (`step` of `total` done) or "preview" (`picture` of that step). `elapsed`: seconds from the
    feed's start (the stream's, after the request was parsed) to when the worker told it."""

    kind: str
    elapsed: float
    step: int = 0
    total: int = 0
    ahead: int | None = None
    picture: Preview | None = None


class StreamFeed(StepListener):
    """One job's events, from the worker's thread to the event loop (the module's docstring)."""

    def __init__(self, wants_preview: Callable[[int, int], bool] | None = None, full: bool = False):
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._lock = threading.Lock()
        self._progress: FeedEvent | None = None
        self._queued: FeedEvent | None = None
        self._pictures: deque[FeedEvent] = deque(maxlen=PENDING_PICTURES)
        self._woken = False  # a wake-up is on its way to the reader: the next events need none
        self._wants = wants_preview
        self.asks_previews, self.preview_full = wants_preview is not None, full
        self.started = time.monotonic()

    # ------------------------------------------------ the worker's thread
    def __call__(self, done: int, total: int) -> None:
        event = FeedEvent("progress", self._elapsed(), step=done, total=total)
        self._keep(lambda: setattr(self, "_progress", event))

    def queued(self, ahead: int) -> None:
        event = FeedEvent("queued", self._elapsed(), ahead=ahead)
        self._keep(lambda: setattr(self, "_queued", event))

    def wants_preview(self, done: int, total: int) -> bool:
        return self._wants is not None and self._wants(done, total)

    def preview(self, done: int, total: int, picture: Preview) -> None:
        event = FeedEvent("preview", self._elapsed(), step=done, total=total, picture=picture)
        self._keep(lambda: self._pictures.append(event))

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _keep(self, store: Callable[[], None]) -> None:
        with self._lock:
            store()
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
    def take(self) -> list[FeedEvent]:
        """The events not yet taken, in the order the worker told them."""
        with self._lock:
            events = [e for e in (self._queued, self._progress) if e is not None] + list(self._pictures)
            self._queued = self._progress = None
            self._pictures.clear()
            self._woken = False
        return sorted(events, key=lambda e: e.elapsed)

    def pending(self) -> int:
        with self._lock:
            return (self._queued is not None) + (self._progress is not None) + len(self._pictures)

    def has_events(self) -> bool:
        return self.pending() > 0

    async def changed(self, timeout: float) -> bool:
        """Wait until an event is kept (or `wake_soon`); False after `timeout` seconds of none."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        self._changed.clear()
        return True
