"""Finding adapters that may wait on the network, on a bounded pool of their own.

Routing a request locates its adapters, and locating one not yet here downloads it (a URL,
Civitai, a bucket) or asks the Hub for its files: seconds, or up to --download-timeout-s
from a host that sends slowly. AnyIO's shared thread pool also carries every request's
parse, routing and image encoding on the way to and from the GPU worker: 40 downloads there
stall every request. So a request whose adapters may wait on the network is routed on this
pool (`FETCH_THREADS` at once, `MAX_PENDING` in all; past it, 503), and a request whose
adapters are all here never waits behind one.
"""

import asyncio
import contextvars
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi.concurrency import run_in_threadpool

from ..adapters.remote import may_download
from ..errors import Overloaded

T = TypeVar("T")

FETCH_THREADS = 8  # downloads and hub reads at once
MAX_PENDING = 256  # requests downloading or waiting to; past it, 503


class FetchPool:
    def __init__(self, threads: int = FETCH_THREADS, max_pending: int = MAX_PENDING):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="loraswap-fetch")
        self.max_pending = max_pending
        self._pending = 0  # counted on the event loop's thread only

    async def run(self, sources, adapter_ids: Iterable[str], call: Callable[..., T], *args) -> T:
        """`call(*args)` in a thread, in the caller's context (its `holding_downloads`): on this
        pool when finding `adapter_ids` in `sources` (an `AdapterSources`) may wait on the
        network, else on AnyIO's."""
        if not any(may_download(sources, adapter_id) for adapter_id in adapter_ids):
            return await run_in_threadpool(call, *args)
        if self._pending >= self.max_pending:
            raise Overloaded(f"{self._pending} requests are waiting for their adapters to download, the most this "
                             "server lets wait; retry later")
        self._pending += 1
        try:
            context = contextvars.copy_context()
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, functools.partial(context.run, call, *args))
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
