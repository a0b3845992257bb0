"""The progress of every generation in flight, for the routes that report it (A1111's
`/sdapi/v1/progress`): `app.state.progress`, a `ProgressBoard`.

`generation.run_generation` enters each request on the board (`ProgressBoard.tracking`) with a
`Tracked` listener in front of the request's own progress hook: it notes the request's place in
the queue, its step, its steps in all and the latest picture of its steps (when the request asked
for pictures), and hands every event on to the hook it wraps. A route reads the board with
`in_flight()` (every request, oldest first) or `current()` (the one generating, else the next).
"""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from loraswap.engine.previews import Preview
from loraswap.engine.step_listener import StepListener
from loraswap.logs import request_id


@dataclass(frozen=True)
class Progress:
    """One request's progress, as read at one moment."""

    route: str
    request_id: str | None
    owner: str | None  # whose request it is (`auth.key_owner`: a digest of its key; None without keys)
    queued: int | None  # requests ahead of it while it waits; None once it generates (or before it is queued)
    step: int  # denoising steps done (0 until the first ends)
    total: int | None  # steps in all, once the first step has ended
    elapsed: float  # seconds since it reached the backend
    preview: Preview | None  # the latest picture of its steps, when it asked for pictures (`Preview.image()`)

    @property
    def fraction(self) -> float:
        """Of its steps, how much is done (0 to 1)."""
        return self.step / self.total if self.total else 0.0


class Tracked(StepListener):
    """A request's progress hook on the board: notes what it hears and hands it on to `inner`
    (the request's own hook, if any: a stream's feed, a video job's percentage)."""

    def __init__(self, route: str, inner: Callable[[int, int], None] | None, owner: str | None = None):
        self.route, self.inner, self.owner = route, inner, owner
        self.request_id = request_id.get()
        self.started = time.monotonic()
        self.listener = inner if isinstance(inner, StepListener) else None
        self.asks_previews = bool(self.listener and self.listener.asks_previews)
        self.preview_full = bool(self.listener and self.listener.preview_full)
        self.ahead: int | None = None
        self.step, self.total = 0, None
        self.latest: Preview | None = None

    def __call__(self, done: int, total: int) -> None:
        self.step, self.total, self.ahead = done, total, None
        if self.inner is not None:
            self.inner(done, total)

    def queued(self, ahead: int) -> None:
        self.ahead = ahead
        if self.listener is not None:
            self.listener.tell_place(ahead)

    def wants_preview(self, done: int, total: int) -> bool:
        return self.listener is not None and self.listener.wants_preview(done, total)

    def preview(self, done: int, total: int, picture: Preview) -> None:
        self.latest = picture
        self.listener.preview(done, total, picture)

    def now(self) -> Progress:
        return Progress(self.route, self.request_id, self.owner, self.ahead, self.step, self.total,
                        time.monotonic() - self.started, self.latest)


class ProgressBoard:
    """The generations in flight in this process (each only while it runs through the backend)."""

    def __init__(self):
        self._tracked: list[Tracked] = []
        self._lock = threading.Lock()

    @contextmanager
    def tracking(self, route: str, on_step: Callable[[int, int], None] | None,
                 owner: str | None = None) -> Iterator[Tracked]:
        """The request on the board until the block ends; yields the hook to hand the backend."""
        tracked = Tracked(route, on_step, owner)
        with self._lock:
            self._tracked.append(tracked)
        try:
            yield tracked
        finally:
            with self._lock:
                self._tracked.remove(tracked)

    def in_flight(self, owner: str | None = None) -> list[Progress]:
        """Every generation in flight, oldest first; with `owner`, only that key's."""
        with self._lock:
            tracked = [t for t in self._tracked if owner is None or t.owner == owner]
        return [t.now() for t in tracked]

    def current(self, owner: str | None = None) -> Progress | None:
        """The oldest generation that has begun its steps, else the oldest in flight (of `owner`'s,
        when given); None when idle."""
        everything = self.in_flight(owner)
        return next((p for p in everything if p.step > 0), everything[0] if everything else None)
