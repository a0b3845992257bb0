"""S3 and S3-compatible stores (MinIO, R2, Ceph, a local server) as an adapter source: `s3://bucket/key`.

boto3 does the talking, so credentials, region, retries and the endpoint come from the standard
AWS settings exactly as boto3 reads them: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN, AWS_PROFILE and the config files, AWS_REGION / AWS_DEFAULT_REGION,
AWS_MAX_ATTEMPTS / AWS_RETRY_MODE, AWS_ENDPOINT_URL, container and instance roles. loraswap adds
only a store other than AWS (`--s3-endpoint-url`), timeouts and a size cap.

The object is as untrusted as a URL's file:
1. a ContentLength over the cap is refused before a byte of the body is read; the cap holds
   while streaming as well, whatever ContentLength said;
2. the safetensors header is checked before the rest is read, so a pickle is refused having
   read only its head;
3. the partial file is deleted on any failure (the download cache renames a complete one);
4. the whole object comes within `total_timeout` (`--download-timeout-s`), answer headers,
   retries and body together, however steadily the store sends it: at the deadline the
   sockets the fetch uses are shut, and no retry starts whose pause could end past it.
Messages name the object (`s3://bucket/key`) and the store's error code, never a credential.
"""

import functools
import hashlib
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions as boto_errors
from botocore.awsrequest import AWSHTTPConnection, AWSHTTPConnectionPool, AWSHTTPSConnection, AWSHTTPSConnectionPool

from loraswap.adapters.files.formats import streamed_header
from loraswap.errors import AdapterError, AdapterForbidden, AdapterInvalid, AdapterNotFound, AdapterUnavailable

logger = logging.getLogger(__name__)

CHUNK = 2**20
RESERVE_AHEAD = 2**20  # an object of no stated length reserves its room a MiB at a time
Reserve = Callable[[int, int], None]  # (bytes the file will have, bytes more it may have)
CREDENTIALS_FIX = ("Give this server credentials that may s3:GetObject it, the standard AWS way: AWS_ACCESS_KEY_ID "
                   "and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary ones), AWS_PROFILE, or an "
                   "instance or container role")
_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_FORBIDDEN = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                        "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "401", "403"})
_BUSY = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable"})
# botocore found no credentials, or could not load the ones it was told to use
_NO_CREDENTIALS = (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError,
                   boto_errors.CredentialRetrievalError, boto_errors.ProfileNotFound, boto_errors.NoAuthTokenError,
                   boto_errors.TokenRetrievalError, boto_errors.SSOError)
# the store did not answer, or broke off: its texts are described, not quoted
_UPSTREAM = ((boto_errors.ConnectTimeoutError, "{store} did not answer within {connect:g} s"),
             (boto_errors.ReadTimeoutError, "{store} sent nothing for {read:g} s"),
             (boto_errors.EndpointConnectionError, "could not connect to {store}"),
             (boto_errors.SSLError, "{store} sent a TLS certificate this server does not accept"),
             (boto_errors.IncompleteReadError, "{store} sent less than the object's size"),
             (boto_errors.HTTPClientError, "the connection to {store} broke"),
             (boto_errors.ConnectionError, "could not connect to {store}"))


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None  # --s3-endpoint-url (MinIO, R2, a local server); None: AWS (or AWS_ENDPOINT_URL)
    max_bytes: int = 2 * 2**30  # an object larger than this is refused, whatever its ContentLength says
    connect_timeout: float = 10.0
    read_timeout: float = 30.0  # per read: no byte for this long is a timeout
    total_timeout: float = 600.0  # the whole object's body, however steadily the store sends it


class _Cutoff:
    """One fetch's deadline and the connections it uses (noted in its thread as botocore checks
    them out or connects them): `cut`, at the deadline, shuts their sockets, so a read waiting on
    one returns at once, whether the store is sending the answer's headers or its body."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.fired = False
        self._connections: list = []
        self._lock = threading.Lock()

    def note(self, connection) -> None:
        with self._lock:
            self._connections.append(connection)
            if self.fired:  # connected after the deadline: cut at once
                _shut(connection)

    def cut(self) -> None:
        with self._lock:
            self.fired = True
            for connection in self._connections:
                _shut(connection)


def _shut(connection) -> None:
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with suppress(OSError):  # the plain socket's shutdown, under TLS too: the reader sees the end
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


_this_fetch = threading.local()  # .cutoff: the `_Cutoff` of the fetch running in this thread, if any


def _note_connection(connection) -> None:
    cutoff = getattr(_this_fetch, "cutoff", None)
    if cutoff is not None:
        cutoff.note(connection)


class _NotedConnection:
    """Mixed into botocore's connection classes: a connection made is noted for its fetch's cutoff."""

    def connect(self):
        super().connect()
        _note_connection(self)


class _NotedPool:
    """Mixed into botocore's pool classes: a connection checked out (one kept alive included) is noted."""

    def _get_conn(self, timeout=None):
        connection = super()._get_conn(timeout)
        _note_connection(connection)
        return connection


class _HTTPConnection(_NotedConnection, AWSHTTPConnection):
    pass


class _HTTPSConnection(_NotedConnection, AWSHTTPSConnection):
    pass


class _HTTPPool(_NotedPool, AWSHTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(_NotedPool, AWSHTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


def _longest_pause(attempts: int) -> float:
    """The longest pause botocore makes before retrying after `attempts` attempts: its backoff,
    at most 2^(attempts - 1) s and 20 s in every retry mode, and a store's x-amz-retry-after at
    most 5 s more."""
    return min(2.0 ** (attempts - 1), 20.0) + 5.0


def _stop_retries_near_the_deadline(attempts: int, **_) -> bool | None:
    """botocore's `needs-retry` hook, asked before its own retry rules: no retry (False) when the
    pause before it could end past the fetch's deadline; else None, botocore's rules decide."""
    cutoff = getattr(_this_fetch, "cutoff", None)
    if cutoff is not None and time.monotonic() + _longest_pause(attempts) >= cutoff.deadline:
        return False
    return None


def _hold_to_deadlines(client) -> None:
    """Make the client's connections cut at a fetch's deadline and its retries stop before it."""
    try:  # botocore's own pool classes, one table shared by the client's pool managers, replaced in place
        client._endpoint.http_session._pool_classes_by_scheme.update(http=_HTTPPool, https=_HTTPSPool)
    except AttributeError:
        logger.warning("this botocore keeps its connections elsewhere: an S3 fetch past its deadline is cut "
                       "only by the per-read timeout")
    client.meta.events.register_first("needs-retry.s3.GetObject", _stop_retries_near_the_deadline)


@functools.lru_cache(maxsize=8)
def s3_client(settings: S3Settings):
    """The client `fetch_s3` uses for these settings, one per settings, kept: boto3 clients are
    thread-safe and slow to make (they load the service model), while sessions are not
    thread-safe, so each client gets a session of its own. Two threads asking first at once may
    each make one; either is fine. Credentials are read when the client is made and refreshed by
    botocore when they expire (roles, SSO)."""
    config = botocore.config.Config(connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout,
                                    user_agent_extra="loraswap")
    # with an endpoint given, botocore addresses buckets by path (`host/bucket/key`), as MinIO needs
    client = boto3.session.Session().client("s3", endpoint_url=settings.endpoint_url, config=config)
    _hold_to_deadlines(client)
    return client


def _store(settings: S3Settings) -> str:
    """The store as messages name it: scheme://host[:port] of the endpoint, never a user or password in it."""
    if not settings.endpoint_url:
        return "S3"
    parts = urlsplit(settings.endpoint_url)
    return f"the store at {parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _code(text: object) -> str:
    """An S3 error code as it may be quoted: a word, never the store's free text."""
    return re.sub(r"[^A-Za-z0-9.]", "", str(text))[:64]


def _client_error(exc: boto_errors.ClientError, shown: str, settings: S3Settings, adapter_id: str) -> AdapterError:
    code = _code(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    said = f"{_store(settings)} answered HTTP {status} {code}".rstrip()
    if code in _NOT_FOUND or status == 404:
        return AdapterNotFound(adapter_id, f"{shown} does not exist ({said})",
                               "Check the bucket and the key (and --s3-endpoint-url for a store other than AWS)")
    if code in _FORBIDDEN or status in (401, 403):
        return AdapterForbidden(adapter_id, f"this server may not read {shown} ({said})", CREDENTIALS_FIX)
    if code in _BUSY or status >= 500:
        return AdapterUnavailable(adapter_id, f"{shown}: {said}", "The store failed or is busy; try again later")
    return AdapterUnavailable(adapter_id, f"{shown}: {said}",
                              "Check --s3-endpoint-url and the region this server uses (AWS_REGION)")


@contextmanager
def _s3_errors(shown: str, settings: S3Settings, adapter_id: str) -> Iterator[None]:
    """botocore's errors as loraswap's: each names the adapter, the problem and the fix."""
    try:
        yield
    except boto_errors.ClientError as exc:
        raise _client_error(exc, shown, settings, adapter_id) from exc
    except _NO_CREDENTIALS as exc:  # the class name only: a profile's or a role's text is not for users
        raise AdapterForbidden(adapter_id, f"no AWS credentials to read {shown} ({type(exc).__name__})",
                               CREDENTIALS_FIX) from exc
    except tuple(kind for kind, _ in _UPSTREAM) as exc:
        text = next(text for kind, text in _UPSTREAM if isinstance(exc, kind))
        problem = text.format(store=_store(settings), connect=settings.connect_timeout, read=settings.read_timeout)
        raise AdapterUnavailable(adapter_id, f"{shown}: {problem}",
                                 "Check that the store is up and reachable from this server (and "
                                 "--s3-endpoint-url), then try again") from exc


def _too_big(shown: str, settings: S3Settings, adapter_id: str) -> AdapterInvalid:
    return AdapterInvalid(adapter_id, f"{shown} is larger than {settings.max_bytes} bytes",
                          "Start the server with a larger --max-adapter-mb if a file this big is meant to be served")


def _read(body, n: int) -> bytes:
    """The next `n` bytes of a streaming body; fewer only where it ends."""
    parts, got = [], 0
    while got < n:
        part = body.read(min(n - got, CHUNK))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _safetensors_head(body, length: int, max_bytes: int, shown: str, adapter_id: str) -> bytes:
    """The 8-byte header length and the JSON header, checked before the rest is read."""
    head = streamed_header(lambda n: _read(body, n), length, adapter_id, max_bytes)
    if head is None:
        raise AdapterInvalid(adapter_id, f"{shown} is not a safetensors file (its first bytes are no header)",
                             "Give the key of a .safetensors file (pickled .ckpt, .pt and .bin files are never loaded)")
    return head


def _write(body, length: int | None, dest: Path, settings: S3Settings, shown: str, adapter_id: str,
           reserve: Reserve) -> tuple[int, str]:
    """Stream `body` into `dest`: the header checked first, the cap held throughout, the room
    reserved before bytes are written; (size, sha256 hex)."""
    if length is not None and length > settings.max_bytes:
        raise _too_big(shown, settings, adapter_id)  # before a byte of the body is read
    head = _safetensors_head(body, settings.max_bytes if length is None else length, settings.max_bytes, shown,
                             adapter_id)
    digest, size = hashlib.sha256(head), len(head)
    with dest.open("wb") as out:
        reserve(length if length is not None else size, 0 if length is not None else RESERVE_AHEAD)
        out.write(head)
        while chunk := body.read(CHUNK):
            size += len(chunk)
            if size > settings.max_bytes:  # ContentLength missing, or a store that lies about it
                raise _too_big(shown, settings, adapter_id)
            reserve(size, RESERVE_AHEAD)
            out.write(chunk)
            digest.update(chunk)
        out.truncate()  # what was reserved past the end
    return size, digest.hexdigest()


@contextmanager
def _cut_off_at(deadline: float, overdue: AdapterUnavailable) -> Iterator[None]:
    """Run this thread's fetch until `deadline` at most: then its sockets are shut (a read waiting
    on one returns at once) and whatever the fetch raises becomes `overdue`. A store sending a
    byte now and then never trips a per-read timeout: this is the whole object's limit."""
    cutoff = _this_fetch.cutoff = _Cutoff(deadline)
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cutoff.cut)
    timer.daemon = True
    timer.start()
    try:
        yield
        if cutoff.fired:  # a read that ended quietly, as a shut socket's may
            raise overdue
    except Exception as e:
        if cutoff.fired or time.monotonic() >= deadline:
            raise overdue from e
        raise
    finally:
        timer.cancel()
        _this_fetch.cutoff = None


def fetch_s3(bucket: str, key: str, dest: Path, settings: S3Settings, adapter_id: str, deadline: float | None = None,
             reserve: Reserve | None = None) -> tuple[int, str]:
    """Stream s3://bucket/key into dest (the caller's temporary path, deleted on any failure) by
    `deadline` (a `time.monotonic()` instant; default: `settings.total_timeout` from now);
    `reserve(bytes, more)` is told the object's size before those bytes are written; (size, sha256 hex)."""
    shown = f"s3://{bucket}/{key}"
    deadline = time.monotonic() + settings.total_timeout if deadline is None else deadline
    overdue = AdapterUnavailable(adapter_id, f"{_store(settings)} did not send {shown} within "
                                 f"{settings.total_timeout:g} s", "Try again later, or raise --download-timeout-s")
    try:
        with _s3_errors(shown, settings, adapter_id), _cut_off_at(deadline, overdue):
            answer = s3_client(settings).get_object(Bucket=bucket, Key=key)
            # bytes left unread: the connection is dropped, not drained
            with closing(answer["Body"]) as body:
                size, sha256 = _write(body, answer.get("ContentLength"), dest, settings, shown, adapter_id,
                                      reserve or (lambda total, ahead: None))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    logger.info("fetched %s for %s: %d B", shown, adapter_id, size)
    return size, sha256
