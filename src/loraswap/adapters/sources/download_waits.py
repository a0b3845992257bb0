"""How a request on the server's fetch pool (`server/fetch_pool.py`) waits for its downloads.

Two rules, carried by the context the pool runs the request in (`fetch_pool_context`):
- its downloads' deadline (--download-timeout-s) counts from the moment it entered the pool
  (`asked_at`), not from when a thread took it up: time queued behind other downloads counts;
- a thread of the pool never waits for another request's fetch of the same adapter in this
  process: `DownloadCache.fetch` raises `FetchInFlight` instead, and the pool awaits that
  fetch on the event loop, holding no thread, then runs the request again (which finds the
  file, or fails as the fetch did). Forty requests naming one slow URL hold one thread, not
  every thread of the pool.
Elsewhere (the store's threads, the CLI) a deadline counts from the call and a wait blocks.
"""

import contextvars
import copy
import time
from concurrent.futures import Future

_asked_at: contextvars.ContextVar[float | None] = contextvars.ContextVar("loraswap_fetch_asked_at", default=None)


def fetch_pool_context(asked_at: float) -> contextvars.Context:
    """The caller's context (its `holding_downloads` included) for a request that entered the
    fetch pool at `asked_at` (a `time.monotonic()` instant)."""
    context = contextvars.copy_context()
    context.run(_asked_at.set, asked_at)
    return context


def asked_at() -> float:
    """When the current request asked for its adapters: on the fetch pool, when it entered it;
    elsewhere, now."""
    entered = _asked_at.get()
    return time.monotonic() if entered is None else entered


def waits_handed_back() -> bool:
    """Whether a wait for another request's fetch is the caller's to make (`FetchInFlight`)."""
    return _asked_at.get() is not None


class FetchInFlight(Exception):  # a signal to the fetch pool, not an error anyone sees
    """Another request of this process is fetching `adapter_id`: wait for `flight` (done once
    that fetch ends, its failure set) without a thread, then ask again."""

    def __init__(self, adapter_id: str, flight: Future):
        super().__init__(adapter_id)
        self.adapter_id, self.flight = adapter_id, flight


def fresh_failure(failure: BaseException) -> BaseException:
    """A new exception like `failure` (its class and arguments, no traceback), for one of the
    requests that shared a fetch: one object raised by many threads would be changed by each
    raise and keep every raiser's frames."""
    try:
        return copy.copy(failure)
    except Exception:  # a class that cannot be rebuilt from its arguments: a plain error with its text
        return RuntimeError(str(failure))
