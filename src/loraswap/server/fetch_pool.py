"""Finding adapters that may wait on the network, on a bounded pool of their own.

Routing a request locates its adapters, and locating one not yet here downloads it (a URL,
Civitai, a bucket) or asks the Hub for its files: seconds, or up to --download-timeout-s
from a host that sends slowly. AnyIO's shared thread pool also carries every request's
parse, routing and image encoding on the way to and from the GPU worker: 40 downloads there
stall every request. So a request whose adapters may wait on the network is routed on this
pool (`FETCH_THREADS` at once, `MAX_PENDING` in all; past it, 503), and a request whose
adapters are all here never waits behind one.

Two rules keep the pool from stalling (`adapters/sources/download_waits.py`):
- a request's download deadline counts from the moment it entered `run`: queued behind
  other downloads for longer than --download-timeout-s, it is refused (503) when a thread
  takes it up, never started late;
- requests naming an adapter another request is already downloading do not each hold a
  thread to wait for it: the thread gives the wait back (`FetchInFlight`), the request awaits
  that download here on the event loop, then runs again, finding the file (or failing as the
  download did). Forty clients naming one slow URL hold one thread, not all of them.
"""

import asyncio
import functools
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from fastapi.concurrency import run_in_threadpool

from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.choose import download_deadline, may_download
from loraswap.adapters.sources.download_waits import FetchInFlight, fetch_pool_context, fresh_failure
from loraswap.adapters.sources.downloads import FOLLOW_GRACE_S
from loraswap.errors import AdapterUnavailable, Overloaded

T = TypeVar("T")

FETCH_THREADS = 8  # downloads and hub reads at once
MAX_PENDING = 256  # requests downloading or waiting to; past it, 503


class FetchPool:
    def __init__(self, threads: int = FETCH_THREADS, max_pending: int = MAX_PENDING):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="loraswap-fetch")
        self.max_pending = max_pending
        self._pending = 0  # counted on the event loop's thread only
        self._following = 0  # of them, those waiting without a thread for another request's download

    @property
    def pending(self) -> int:
        """Requests downloading, or waiting for a thread or another request's download."""
        return self._pending

    @property
    def following(self) -> int:
        """Requests waiting, without a thread, for another request's download."""
        return self._following

    async def run(self, sources, refs: Iterable[AdapterRef], call: Callable[..., T], *args) -> T:
        """`call(*args)` in a thread, in the caller's context (its `holding_downloads`): on this
        pool when finding `refs` in `sources` (an `AdapterSources`) may wait on the network,
        else on AnyIO's; run again after each wait for another request's download."""
        refs, asked = list(refs), time.monotonic()
        deadline = download_deadline(sources, asked)
        job = functools.partial(fetch_pool_context(asked).run, _unless_overdue, deadline, call, *args)
        counted = False
        try:
            while True:
                pooled = any(may_download(sources, ref) for ref in refs)
                if pooled and not counted:
                    self._count_in()
                    counted = True
                try:
                    return await (self._in_pool(job) if pooled else run_in_threadpool(job))
                except FetchInFlight as waiting:
                    self._following += 1
                    try:
                        await _await_flight(waiting.adapter_id, waiting.flight, deadline)
                    finally:
                        self._following -= 1
        finally:
            if counted:
                self._pending -= 1

    def _count_in(self) -> None:
        if self._pending >= self.max_pending:
            raise Overloaded(f"{self._pending} requests are waiting for their adapters to download, the most this "
                             "server lets wait; retry later")
        self._pending += 1

    async def _in_pool(self, job: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _unless_overdue(deadline: float, call: Callable[..., T], *args) -> T:
    """`call(*args)`, unless the request's download deadline passed while it was queued (or
    waited for another request's download)."""
    if time.monotonic() >= deadline:
        raise Overloaded("this request waited for a download thread longer than --download-timeout-s: the server's "
                         "downloads are busy; retry later")
    return call(*args)


async def _await_flight(adapter_id: str, flight: Future, deadline: float) -> None:
    """Wait, holding no thread, for another request's download of `adapter_id` (`flight`), until
    this request's deadline and a moment; its failure is this request's too."""
    waited = asyncio.wrap_future(flight)
    waited.add_done_callback(_taken)
    timeout = max(0.0, deadline + FOLLOW_GRACE_S - time.monotonic()) if deadline < math.inf else None
    if not (await asyncio.wait([waited], timeout=timeout))[0]:  # asyncio.wait never cancels the download
        raise AdapterUnavailable(adapter_id, "it is still being fetched for another request", "Try again later")
    failure = waited.exception()
    if failure is not None:
        raise fresh_failure(failure) from failure


def _taken(waited: asyncio.Future) -> None:
    """A download's outcome, once in: taken, so that asyncio logs nothing for a wait given up."""
    if not waited.cancelled():
        waited.exception()
