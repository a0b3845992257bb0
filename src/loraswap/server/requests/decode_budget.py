"""How many bytes of input images all requests together may hold decoded at once.

A 4096² image is 67 MB once decoded as RGBA, however well its file compresses; sixteen such
requests at once, each with a mask, took a server from 0.5 GB to 3.3 GB. Each request says
what its files will cost to decode (`media.images.decode_cost`, from their headers) and
decodes only once that fits under `--max-decode-mb` beside what other requests hold; it
waits for room up to `WAIT_S`, then gets a 503. After the decode it goes on holding what
its decoded image and mask take (`decoded_bytes`) until it has been answered
(`release_decoded`, a route dependency), so requests waiting in the GPU worker's queue
count too. A request that alone costs more than the budget is refused (400), saying so.
"""

import asyncio
import ctypes
import time
from collections.abc import AsyncIterator

from fastapi import Request
from PIL import Image

from loraswap.errors import BadRequest, Overloaded

WAIT_S = 30.0
TRIM_EVERY_S = 5.0  # at most this often, freed image memory is handed back to the system


def decoded_bytes(*images: Image.Image | None) -> int:
    """What decoded images take while they wait to be generated from."""
    return sum(image.width * image.height * len(image.getbands()) for image in images if image is not None)


def _malloc_trim():
    """glibc's `malloc_trim`, or None (not glibc): freed image buffers otherwise stay in the
    process's arenas, counted in its resident memory."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class DecodeBudget:
    """The bytes held, owned by the app (`app.state.decode_budget`), used on its event loop."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.held = 0
        self._room: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trim = _malloc_trim()
        self._trimmed_at = 0.0

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # an app served by a new loop (tests start several)
            self._room, self._loop = asyncio.Condition(), loop
        return self._room

    async def acquire(self, cost: int) -> None:
        """Hold `cost` bytes once they fit; BadRequest if they never can, Overloaded after `WAIT_S`."""
        if cost > self.max_bytes:
            raise BadRequest(f"decoding the input images takes {cost / 2**20:.0f} MiB, over this server's "
                             f"{self.max_bytes / 2**20:.0f} MiB for decoding (--max-decode-mb): send a smaller image")
        room = self._condition()
        async with room:
            try:
                await asyncio.wait_for(room.wait_for(lambda: self.held + cost <= self.max_bytes), WAIT_S)
            except TimeoutError:
                raise Overloaded(f"the server holds {self.held / 2**20:.0f} MiB of decoded images for other "
                                 "requests; retry shortly") from None
            self.held += cost

    async def release(self, cost: int) -> None:
        if not cost:
            return
        self.held -= cost  # before any await: a cancellation while waiting for the lock must not lose it
        room = self._condition()
        async with room:
            room.notify_all()
        if self.held == 0 and self._trim is not None and time.monotonic() - self._trimmed_at > TRIM_EVERY_S:
            self._trimmed_at = time.monotonic()
            asyncio.get_running_loop().run_in_executor(None, self._trim, 0)  # it walks every arena: off the loop


async def release_decoded(request: Request) -> AsyncIterator[None]:
    """Route dependency: what the request's decoded images hold (`request.state.decoded_bytes`,
    set by the parse) is given back once the request is done, however it ends."""
    request.state.decoded_bytes = 0
    try:
        yield
    finally:
        await release_decoded_now(request)


async def release_decoded_now(request: Request) -> None:
    """Give back what the request's decoded images hold now (a stream, once its image is made,
    before a slow client has read it), once: `release_decoded` then gives back nothing."""
    held, request.state.decoded_bytes = getattr(request.state, "decoded_bytes", 0), 0
    await request.app.state.decode_budget.release(held)
