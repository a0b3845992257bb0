"""What a request's client hears while its job waits and generates, from the GPU worker.

A job's progress hook is any `on_step(steps done, steps in all)` callable, called after each
denoising step (a progress bar, a video job's percentage). A `StepListener` is such a hook that
hears more: `queued(ahead)` while the job waits (how many requests are ahead of it), and
`preview(done, total, picture)` after the steps it `wants_preview` for: a picture of that step's
latents (`previews.Preview`), a sketch or, with `preview_full`, the VAE's. The worker asks the
engine for pictures only for listeners whose `asks_previews` is true, and only at the steps
they want, so a request that asks for none costs nothing more than its step count.

Every method runs on the worker's thread, between steps: it must be quick and never block.
"""

import logging
from collections.abc import Callable

from loraswap.engine.previews import Preview

logger = logging.getLogger(__name__)


class StepListener:
    """A progress hook that also hears its job's place in the queue and pictures of its steps.
    The defaults hear nothing; a subclass overrides what it wants."""

    asks_previews: bool = False  # whether `wants_preview` may ever say yes
    preview_full: bool = False  # its pictures decoded by the VAE (else sketched: the linear map)
    _place: int | None = None  # the place it was last told (`tell_place`)

    def __call__(self, done: int, total: int) -> None:
        """After each denoising step."""

    def queued(self, ahead: int) -> None:
        """The job waits in the queue behind `ahead` requests (told again when that changes)."""

    def tell_place(self, ahead: int) -> None:
        """The worker's word of the job's place: `queued` once for each new place."""
        if ahead != self._place:
            self._place = ahead
            self.queued(ahead)

    def wants_preview(self, done: int, total: int) -> bool:
        """Whether a picture of the latents after step `done` is wanted."""
        return False

    def preview(self, done: int, total: int, picture: Preview) -> None:
        """A picture of the latents after step `done`."""


def every_steps(every: int, done: int, total: int) -> bool:
    """A picture every `every` steps, but none after the last one (the image itself follows)."""
    return every > 0 and done % every == 0 and done < total


def spread_steps(count: int, done: int, total: int) -> bool:
    """`count` pictures spread evenly over the steps (OpenAI's `partial_images`), none after the
    last one: fewer when there are too few steps."""
    return done < total and any(done == (total * k) // (count + 1) for k in range(1, count + 1))


def tell_places(hooks: list[Callable | None]) -> None:
    """Each listening job of the queue (in order) its place in it."""
    for ahead, hook in enumerate(hooks):
        if isinstance(hook, StepListener):
            _heard(hook.tell_place, ahead)


def pictures_asked(hook: Callable | None) -> str | None:
    """What pictures a job's progress hook asks for: None, "sketch" or "full" (the VAE's), which
    the worker batches apart: a full picture's decode slows every image of its batch."""
    if not isinstance(hook, StepListener) or not hook.asks_previews:
        return None
    return "full" if hook.preview_full else "sketch"


def previews_hook(hooks: list[Callable | None]) -> Callable | None:
    """The engine's latents hook for a batch whose jobs' progress hooks are `hooks` (in the
    batch's order): `(done, total, step_latents)` making the pictures the listeners want at that
    step; None when none of them asks for pictures (then nothing at all is computed)."""
    asking = [(i, hook) for i, hook in enumerate(hooks) if isinstance(hook, StepListener) and hook.asks_previews]
    if not asking:
        return None

    def pictures_wanted(done: int, total: int, step_latents) -> None:
        for full in (False, True):
            wanted = [(i, hook) for i, hook in asking if hook.preview_full == full and hook.wants_preview(done, total)]
            if not wanted:
                continue
            try:
                pictures = step_latents.pictures([i for i, _ in wanted], full)
            except Exception:  # a picture never fails the image
                logger.exception("previews of step %d of %d failed", done, total)
                continue
            for (_, hook), picture in zip(wanted, pictures):
                _heard(hook.preview, done, total, picture)

    return pictures_wanted


def _heard(method: Callable, *args) -> None:
    """A listener's method; one that fails is logged, never the job's or the batch's failure."""
    try:
        method(*args)
    except Exception:
        logger.exception("a step listener failed")
