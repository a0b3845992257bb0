"""How many bytes of input images all requests together may be decoding at once.

A 4096² image is 67 MB once decoded as RGBA, however well its file compresses; sixteen such
requests at once, each with a mask, took a server from 0.5 GB to 4 GB. Each request says
what its files will cost to decode (`media.images.decode_cost`, from their headers) and
decodes only once that fits under `--max-decode-mb` beside the decodes in flight; it waits
for room up to `WAIT_S`, then gets a 503. A request that alone costs more than the budget
is refused (400), saying so.
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..errors import BadRequest, Overloaded

WAIT_S = 30.0


class DecodeBudget:
    """The bytes in flight, owned by the app (`app.state.decode_budget`), used on its event loop."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.in_flight = 0
        self.most_in_flight = 0  # the peak, for /metrics and the tests
        self._room: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # an app served by a new loop (tests start several)
            self._room, self._loop = asyncio.Condition(), loop
        return self._room

    @asynccontextmanager
    async def hold(self, cost: int) -> AsyncIterator[None]:
        """Hold `cost` bytes of the budget for the block."""
        if cost > self.max_bytes:
            raise BadRequest(f"decoding the input images takes {cost / 2**20:.0f} MiB, over this server's "
                             f"{self.max_bytes / 2**20:.0f} MiB for decoding (--max-decode-mb): send a smaller image")
        room = self._condition()
        async with room:
            try:
                await asyncio.wait_for(room.wait_for(lambda: self.in_flight + cost <= self.max_bytes), WAIT_S)
            except TimeoutError:
                raise Overloaded(f"the server is decoding {self.in_flight / 2**20:.0f} MiB of images for other "
                                 "requests; retry shortly") from None
            self.in_flight += cost
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield
        finally:
            async with room:
                self.in_flight -= cost
                room.notify_all()
