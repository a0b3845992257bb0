"""Video jobs' webhooks: when a job ends (completed, failed, or deleted before it finished),
the URL it gave (`webhook_url`) is called once with the event, in Standard Webhooks' payload
shape: `{"type": "video.completed" | "video.failed", "timestamp": ISO 8601, "data": the job
as GET /v1/videos/{id} shows it then}`.

Signed as Standard Webhooks specifies (`standardwebhooks`, with `--webhook-secret`): the
headers `webhook-id` (the same for every try, so a receiver can drop a repeat),
`webhook-timestamp` (this try's) and `webhook-signature` (`v1,` and the base64 HMAC-SHA256
of `ID.TIMESTAMP.BODY`). A try that fails (no connection, a timeout, an answer other than
2xx: redirects are not followed) is tried again after `--webhook-retry-s`, doubled each time
up to `MAX_WAIT_S`, up to `--webhook-attempts` tries, then given up (logged); one the rules
refuse (`webhook_rules`: the URL, or the address its name resolves to now) is given up at
once. The URL meets the rules at every try, its address checked as the socket opens; a try
takes at most `--webhook-timeout-s`, its DNS lookup included, and reads at most
`MAX_ANSWER_BYTES` of the answer.

What is owed is bounded: a job asking for a webhook holds a slot from the moment it is made
(`reserve`: 503 past `--webhook-pending` in all, or `--webhook-pending-per-key` for its API
key) until its delivery is delivered or given up, so a key making and deleting jobs, which
costs no GPU, cannot fill the queue for the others. Tries run on `--webhook-workers` threads
of their own (never the event loop's, nor the request handlers'), one at a time to any one
host (scheme, name and port), so a slow host holds one thread, not all of them.

A delivery is kept in the state folder (`state.VideoState`, the `webhooks` table) from
the moment its job ends (in the job's own transaction) until it is delivered or given up, so
a restart in between still delivers it. A delivery cut short by a stop may have arrived: it
is sent again, under the same `webhook-id`. A log shows a webhook's URL only as its origin
(`webhook_rules.origin`): its path often holds the receiver's token.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import httpcore
import httpx
from pydantic import BaseModel, ConfigDict, Field
from standardwebhooks import Webhook

from loraswap.adapters.sources.addresses import CheckedBackend, Lookup, system_lookup
from loraswap.errors import LoraswapError, Overloaded
from loraswap.server.config import WebhookConfig
from loraswap.server.videos.state import WRITE_ERRORS
from loraswap.server.videos.webhook_rules import checked_url, origin

logger = logging.getLogger("loraswap.server")

MAX_ANSWER_BYTES = 4096  # of a receiver's answer: read, then the connection dropped
MAX_WAIT_S = 3600.0  # the longest wait between two tries, however many have failed


class Delivery(BaseModel):
    """One webhook owed: kept as a row of the state folder's `webhooks` table (strict: a row
    changed by hand into other types is dropped, not sent)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str  # `webhook-id`: msg_ and 32 hex digits, the same at every try
    video_id: str
    url: str
    payload: str  # the event as JSON, the job as it was when it ended
    attempts: int = Field(0, ge=0)  # tries made
    next_at: float = Field(0.0, allow_inf_nan=False)  # when to try next (wall-clock seconds)
    owner: str | None = None  # the job's owner (`VideoStore.owner_of`): whose count it is in


class WebhooksFull(Overloaded):
    """503: this server (or this API key) is owed as many webhooks as it may be."""


@dataclass(frozen=True)
class Failure:
    """Why a try failed; `final`: the rules refuse it, so no later try would be let through."""

    why: str
    final: bool = False


def event(job_view: dict, now: float) -> dict:
    """Standard Webhooks' payload of a job that ended at `now`: its type, when, and the job."""
    kind = "video.completed" if job_view["status"] == "completed" else "video.failed"
    stamp = datetime.fromtimestamp(now, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": kind, "timestamp": stamp, "data": job_view}


def owed(video_id: str, url: str, job_view: dict, now: float, owner: str | None = None) -> Delivery:
    """The delivery of a job that ended now, due at once."""
    return Delivery(id="msg_" + secrets.token_hex(16), video_id=video_id, url=url, owner=owner, next_at=now,
                    payload=json.dumps(event(job_view, now), separators=(",", ":")))


def signed_headers(secret: str, delivery: Delivery, now: float) -> dict[str, str]:
    """The Standard Webhooks headers of one try made at `now` (Unix seconds)."""
    signature = Webhook(secret).sign(delivery.id, datetime.fromtimestamp(now, tz=timezone.utc), delivery.payload)
    return {"webhook-id": delivery.id, "webhook-timestamp": str(int(now)), "webhook-signature": signature}


def retry_wait(attempts: int, retry_s: float) -> float:
    """Seconds before the next try once `attempts` tries failed: `retry_s`, doubled at each
    failure, at most `MAX_WAIT_S`."""
    return min(retry_s * 2.0 ** min(attempts - 1, 64), MAX_WAIT_S)


def try_once(delivery: Delivery, config: WebhookConfig, resolver: Executor | None = None) -> Failure | None:
    """POST the delivery once: None when the receiver answered 2xx, else why not. Blocking; the
    DNS lookup runs on `resolver` (None: on this thread), held to the try's time too."""
    try:
        url = checked_url(delivery.url, config.allow, shown=origin(delivery.url))
        status = _post(url, delivery.payload.encode(), signed_headers(config.secret, delivery, time.time()), config,
                       resolver)
    except httpcore.TimeoutException:  # the deadline too (`addresses.Overdue`)
        return Failure(f"no answer within {config.timeout_s:g} s")
    except (httpcore.NetworkError, httpcore.ProtocolError) as e:
        return Failure(f"the connection failed ({str(e)[:200] or type(e).__name__})")
    except LoraswapError as e:  # the rules: the URL, or the address its name resolves to, refused
        return Failure(getattr(e, "problem", None) or e.message, final=True)
    except Exception:  # a bug of ours: the delivery is still tried again, and given up in the end
        logger.exception("webhook %s: a try failed unexpectedly", delivery.id)
        return Failure("an internal error")
    if not 200 <= status < 300:
        return Failure(f"answered HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else ""))
    return None


def _post(url: httpx.URL, body: bytes, headers: dict[str, str], config: WebhookConfig,
          resolver: Executor | None) -> int:
    """The receiver's status; at most MAX_ANSWER_BYTES of its answer read, the whole try held
    to `timeout_s` (the lookup, every read and write: `CheckedBackend`'s deadline)."""
    deadline = time.monotonic() + config.timeout_s
    lookup = _lookup_until(resolver, deadline) if resolver is not None else system_lookup
    backend = CheckedBackend(tuple(config.allow), "webhook", deadline, lookup)
    timeout = {kind: config.timeout_s for kind in ("connect", "pool", "read", "write")}
    sent = [("Host", url.netloc.decode("ascii")), ("User-Agent", "loraswap"), ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))), *headers.items()]
    target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
    # a pool per try, so no connection outlives its address check
    with httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), network_backend=backend) as pool:
        response = pool.handle_request(httpcore.Request(b"POST", target, headers=sent, content=body,
                                                        extensions={"timeout": timeout}))
        try:
            read = 0
            for chunk in response.iter_stream():
                read += len(chunk)
                if read >= MAX_ANSWER_BYTES:
                    break
        finally:
            response.close()
    return response.status


def _lookup_until(resolver: Executor, deadline: float) -> Lookup:
    """A DNS lookup run on `resolver` and waited for until `deadline` (a `time.monotonic()`
    instant): a resolver that hangs holds one of `resolver`'s threads, never a try past its time."""
    def lookup(host: str, port: int) -> list[tuple]:
        future = resolver.submit(system_lookup, host, port)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:  # (concurrent.futures'): the lookup's own errors are OSErrors, raised above
            future.cancel()  # one still queued never runs
            raise httpcore.ConnectTimeout(f"{host} did not resolve in time") from None

    return lookup


class WebhookSender:
    """The webhooks owed by this server's video jobs, tried in the background (`start`) until
    delivered or given up, each kept in `state` (a `VideoState`) meanwhile."""

    def __init__(self, config: WebhookConfig, state, clock: Callable[[], float] = time.time):
        self.config, self.state, self.clock = config, state, clock
        self._reserved: dict[str, str | None] = {}  # job id -> owner: jobs that will owe a webhook when they end
        self._pending: dict[str, Delivery] = {}  # delivery id -> delivery: owed now
        self._tasks: dict[str, asyncio.Task] = {}
        self._hosts: dict[str, tuple[asyncio.Lock, int]] = {}  # origin -> (its turn, tries waiting on it)
        self._pool: ThreadPoolExecutor | None = None  # the tries' threads, made by `start`
        self._resolver: ThreadPoolExecutor | None = None  # their DNS lookups'

    # ---------------------------------------------------------------- what is owed
    def reserve(self, video_id: str, owner: str | None, capped: bool = True) -> None:
        """A slot for the webhook job `video_id` will owe when it ends; WebhooksFull (503) when
        none is left, in all (`pending`) or for `owner` (`pending_per_key`; None: no API keys,
        only the total counts). `capped` False: a job found unfinished at a start, owed already."""
        if capped:
            owed = len(self._reserved) + len(self._pending)
            if owed >= self.config.pending:
                raise WebhooksFull(f"the video jobs owe {owed} webhooks (jobs not finished, or webhooks not "
                                   "delivered yet), the most this server keeps (--webhook-pending); retry later")
            own = self._owed_to(owner) if owner is not None else 0
            if own >= self.config.pending_per_key:
                raise WebhooksFull(f"this API key's video jobs owe {own} webhooks (jobs not finished, or webhooks "
                                   "not delivered yet), the most one key's may (--webhook-pending-per-key); retry "
                                   "once they are delivered")
        self._reserved[video_id] = owner

    @contextlib.contextmanager
    def reserving(self, video_id: str, owner: str | None, wanted: bool = True) -> Iterator[None]:
        """`reserve` (when `wanted`), the slot given back if the block raises: the job was not made."""
        if wanted:
            self.reserve(video_id, owner)
        try:
            yield
        except BaseException:
            self._reserved.pop(video_id, None)
            raise

    def send(self, delivery: Delivery, kept: bool = False) -> None:
        """Owe `delivery`, in the slot its job held: kept in the state folder (unless `kept`
        already, with its job), then tried as soon as the sender runs."""
        self._reserved.pop(delivery.video_id, None)
        if not kept:
            self._keep(delivery)
        self._pending[delivery.id] = delivery
        self._maybe_schedule(delivery)

    def _owed_to(self, owner: str) -> int:
        reserved = sum(1 for reserver in self._reserved.values() if reserver == owner)
        return reserved + sum(1 for delivery in self._pending.values() if delivery.owner == owner)

    # ---------------------------------------------------------------- lifespan
    def start(self) -> None:
        """Try the deliveries owed, those a restart left in the state folder first."""
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="loraswap-webhook")
        self._resolver = ThreadPoolExecutor(self.config.workers, thread_name_prefix="loraswap-webhook-dns")
        for delivery in self._kept_deliveries():
            self._pending.setdefault(delivery.id, delivery)
        if self._pending and self.config.secret is None:
            logger.error("%d webhooks owed are not sent: the server has no --webhook-secret to sign them with; they "
                         "are kept for a start with one", len(self._pending))
        for delivery in self._pending.values():
            self._maybe_schedule(delivery)

    def _kept_deliveries(self) -> list[Delivery]:
        """The deliveries the state folder keeps; a row that cannot be read dropped, a table that
        cannot be read logged (the server starts all the same)."""
        try:
            rows = self.state.deliveries()
        except WRITE_ERRORS as e:
            logger.error("the webhooks owed cannot be read from the state folder, so they are not sent: %s", e)
            return []
        kept = []
        for row in rows:
            try:
                kept.append(Delivery.model_validate(row))
            except ValueError as e:
                logger.error("dropping webhook %.80r: its row in the state folder cannot be read: %s", row["id"], e)
                self._remove(row["id"])
        return kept

    async def stop(self) -> None:
        """Stop trying; what is owed stays in the state folder for the next start."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pool in (self._pool, self._resolver):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)  # a try under way ends within timeout_s

    # ---------------------------------------------------------------- tries
    def _maybe_schedule(self, delivery: Delivery) -> None:
        if self._pool is not None and self.config.secret is not None and delivery.id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._deliver(delivery), name=f"loraswap-{delivery.id}")
            self._tasks[delivery.id] = task
            task.add_done_callback(lambda _: self._tasks.pop(delivery.id, None))

    async def _deliver(self, delivery: Delivery) -> None:
        """Try until delivered, refused by the rules, or out of tries, waiting the back-off
        between tries and the host's turn before each."""
        loop = asyncio.get_running_loop()
        host = origin(delivery.url)
        shown = f"video {delivery.video_id}: webhook {delivery.id} to {host}"
        while True:
            await asyncio.sleep(max(0.0, delivery.next_at - self.clock()))
            async with self._turn_of(host):
                failure = await loop.run_in_executor(self._pool, try_once, delivery, self.config, self._resolver)
            delivery.attempts += 1
            if failure is None:
                logger.info("%s delivered (try %d)", shown, delivery.attempts)
                return self._done(delivery)
            if failure.final or delivery.attempts >= self.config.attempts:
                logger.error("%s given up after %d tries: %s", shown, delivery.attempts, failure.why)
                return self._done(delivery)
            wait = retry_wait(delivery.attempts, self.config.retry_s)
            logger.warning("%s failed (try %d of %d): %s; trying again in %g s", shown, delivery.attempts,
                           self.config.attempts, failure.why, wait)
            delivery.next_at = self.clock() + wait
            self._keep(delivery)

    @contextlib.asynccontextmanager
    async def _turn_of(self, host: str) -> AsyncIterator[None]:
        """One try at a time to `host` (an origin): the others wait here, on the event loop,
        holding no thread."""
        lock, waiting = self._hosts.get(host, (asyncio.Lock(), 0))
        self._hosts[host] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._hosts[host]
            if waiting == 1:
                del self._hosts[host]
            else:
                self._hosts[host] = (lock, waiting - 1)

    def _done(self, delivery: Delivery) -> None:
        self._pending.pop(delivery.id, None)
        self._remove(delivery.id)

    def _keep(self, delivery: Delivery) -> None:
        try:
            self.state.save_delivery(delivery.model_dump())
        except WRITE_ERRORS as e:  # it is still tried; only not across a restart
            logger.error("webhook %s is not kept across a restart: writing its row failed: %s", delivery.id, e)

    def _remove(self, delivery_id: object) -> None:
        try:
            self.state.remove_delivery(delivery_id)
        except WRITE_ERRORS as e:  # the next start sends it again, under the same webhook-id
            logger.error("webhook %.80r: removing its row failed: %s", delivery_id, e)
