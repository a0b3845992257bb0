"""The one way loraswap fetches a URL a user gave (a `.safetensors` link, a Civitai API answer).

The URL is hostile input. `https` always; plain `http` only to a host a `--url-allow` pattern
names without a wildcard; the host must match a pattern; the address connected to is checked as
the socket opens (no DNS-rebinding window): loopback, private, link-local, multicast, reserved,
CGNAT and cloud-metadata addresses only when a pattern names that host or IP literally. Every
redirect is checked again; a timeout per connect and per read, and a deadline for the whole
fetch (a host dripping bytes is cut off); the size cap held while streaming; a safetensors
header checked before the body. URLs reach messages only through `display_url` (no query, no
userinfo). httpcore (httpx's transport) is used directly: in its network backend
(`addresses.CheckedBackend`) the host name meets the socket.
"""

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpcore
import httpx

from loraswap.adapters.files.formats import streamed_header
from loraswap.adapters.sources.addresses import CheckedBackend, Overdue, allowed_host, named, usable_addresses
from loraswap.errors import AdapterError, AdapterForbidden, AdapterInvalid, AdapterNotFound, AdapterUnavailable

logger = logging.getLogger(__name__)

_REDIRECTS = (301, 302, 303, 307, 308)
RESERVE_AHEAD = 2**20  # a body of no declared length reserves its room a MiB at a time
Reserve = Callable[[int, int], None]  # (bytes the file will have, bytes more it may have)
_SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie")  # never sent to another origin
@dataclass(frozen=True)
class FetchRules:
    allow: tuple[str, ...]  # `--url-allow` patterns: "host" or "host:port", fnmatch; "*" = any PUBLIC host
    max_bytes: int  # size cap, enforced while streaming whatever Content-Length says
    connect_timeout: float = 10.0
    read_timeout: float = 30.0  # per read: no byte for this long is a timeout
    total_timeout: float = 600.0  # the whole fetch, redirects and headers included
    deadline: float | None = None  # when it ends (a `time.monotonic()` instant), if set before it starts
    max_redirects: int = 5


@dataclass(frozen=True)
class Fetched:
    path: Path  # the file written (the `dest` given)
    size: int
    sha256: str  # hex of the bytes written
    etag: str | None
    final_url: str  # after redirects, through display_url (signed URLs' signatures never kept)


def display_url(url: str) -> str:
    """scheme://host[:port]/path: what of a URL may appear in logs and errors."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an unparseable URL)"
    path = parsed.raw_path.split(b"?")[0].decode("ascii", "replace")
    return f"{parsed.scheme}://{parsed.netloc.decode('ascii')}{path}"[:200]


def _port(url: httpx.URL) -> int:
    return url.port or {"https": 443, "http": 80}.get(url.scheme, 0)


def _checked(url: str, rules: FetchRules, adapter_id: str, base: httpx.URL | None = None) -> httpx.URL:
    """Rules 1 and 2 for the URL given or a redirect's `Location` (relative to `base`)."""
    try:
        parsed = base.join(url) if base else httpx.URL(url)
    except httpx.InvalidURL:
        raise AdapterInvalid(adapter_id, "its URL could not be parsed", "Give an https:// URL to the file") from None
    host, port = parsed.raw_host.decode("ascii"), _port(parsed)
    lead = (f"{display_url(str(base))} redirected to " if base else "") + display_url(str(parsed))
    if parsed.scheme not in ("https", "http") or not host or not 0 < port < 2**16:
        raise AdapterForbidden(adapter_id, f"{lead}: only https://HOST[:PORT] URLs are fetched",
                               "Give an https:// URL")
    if parsed.userinfo:
        raise AdapterForbidden(adapter_id, f"{lead}: the URL carries a user name or password",
                               "Leave credentials out of the URL; the source's token is sent as a header")
    if not allowed_host(host, port, rules.allow):
        raise AdapterForbidden(adapter_id, f"{lead}: host {host} is not allowed",
                               f"Start the server with --url-allow {host}")
    if parsed.scheme == "http" and not named(host, port, rules.allow):
        raise AdapterForbidden(adapter_id, f"{lead}: plain http", f"Give an https:// URL: plain http is fetched only "
                               f"from a host --url-allow names (e.g. --url-allow {host}:{port}, no wildcard)")
    return parsed


def check_url(url: str, rules: FetchRules, adapter_id: str) -> None:
    """What a fetch of `url` checks before it sends a byte (the scheme, the host's patterns, the
    addresses its name resolves to), for a file already downloaded: AdapterForbidden if this
    server would not fetch it. A name that does not resolve now passes: no address to refuse."""
    parsed = _checked(url, rules, _safe_id(adapter_id))
    try:
        usable_addresses(parsed.raw_host.decode("ascii"), _port(parsed), rules.allow, _safe_id(adapter_id))
    except httpcore.ConnectError:
        pass


def _request(url: httpx.URL, headers: dict[str, str], rules: FetchRules) -> httpcore.Request:
    # the parts of the URL checked above, handed over as parts: httpcore parses nothing again
    target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
    sent = {"Host": url.netloc.decode("ascii"), "User-Agent": "loraswap", "Accept-Encoding": "identity"}
    sent.update((k, v) for k, v in headers.items() if k.lower() != "host")
    connect, read = rules.connect_timeout, rules.read_timeout
    timeout = {"connect": connect, "pool": connect, "read": read, "write": read}  # read: each read, not the whole
    return httpcore.Request(b"GET", target, headers=list(sent.items()), extensions={"timeout": timeout})


def _header(response: httpcore.Response, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in reversed(response.headers) if key.lower() == name), None)


def _open(pool: httpcore.ConnectionPool, url: str, rules: FetchRules, adapter_id: str,
          headers: dict[str, str]) -> tuple[httpcore.Response, httpx.URL]:
    """GET `url`, following redirects (each one checked again); the last response, its body unread."""
    current = _checked(url, rules, adapter_id)
    for _ in range(rules.max_redirects + 1):
        response = pool.handle_request(_request(current, headers, rules))
        location = _header(response, b"location")
        if response.status not in _REDIRECTS or location is None:
            return response, current
        response.close()
        following = _checked(location, rules, adapter_id, base=current)
        if (following.scheme, following.host, _port(following)) != (current.scheme, current.host, _port(current)):
            headers = {k: v for k, v in headers.items() if k.lower() not in _SECRET_HEADERS}
        current = following
    raise AdapterUnavailable(adapter_id, f"{display_url(url)} redirected more than {rules.max_redirects} times",
                             "Give the file's final URL, or ask its host to fix its redirects")


_STATUSES = {404: (AdapterNotFound, "Check the URL: the file is gone or was never there"),
             401: (AdapterForbidden, "Check the token this source sends (e.g. CIVITAI_TOKEN) and that it has "
                                     "permission to download this file"),
             429: (AdapterUnavailable, "The file's host is busy; try again later")}  # 429: as much as a 503
_STATUSES |= {410: _STATUSES[404], 403: _STATUSES[401]}


def _check_status(response: httpcore.Response, shown: str, adapter_id: str) -> None:
    if not 200 <= response.status < 300:
        error, fix = _STATUSES.get(response.status) or (
            (AdapterUnavailable, "The file's host failed; try again later") if response.status >= 500 else
            (AdapterInvalid, "Check the URL: it should lead to the file itself"))
        raise error(adapter_id, f"{shown} answered HTTP {response.status}", fix)


# an upstream failure and what it says; socket and h11 texts name no URL, and local protocol
# errors (which can quote a header we sent, a token) are described, not quoted
_UPSTREAM = ((Overdue, "its host did not send the whole answer within {total:g} s"),
             (httpcore.ConnectTimeout, "its host did not answer within {connect:g} s"),
             (httpcore.TimeoutException, "its host sent nothing for {read:g} s"),
             (httpcore.ConnectError, "could not connect to its host ({exc})"),
             (httpcore.RemoteProtocolError, "its host broke off or garbled the answer ({exc})"),
             (httpcore.NetworkError, "the connection broke ({exc})"),
             (httpcore.LocalProtocolError, "the request could not be sent (a malformed header)"))


@contextmanager
def _upstream_errors(url: str, rules: FetchRules, adapter_id: str) -> Iterator[None]:
    try:
        yield
    except tuple(kind for kind, _ in _UPSTREAM) as exc:
        text = next(text for kind, text in _UPSTREAM if isinstance(exc, kind))
        problem = text.format(connect=rules.connect_timeout, read=rules.read_timeout, total=rules.total_timeout,
                              exc=str(exc)[:200] or "closed")
        raise AdapterUnavailable(adapter_id, f"{display_url(url)}: {problem}",
                                 "Check that the host is up and reachable from this server, then try again") from exc


class _Body:
    """A response's bytes as they arrive; `too_big` is raised once more than `cap` have come."""

    def __init__(self, response: httpcore.Response, cap: int, too_big: Callable[[], AdapterError]):
        length = _header(response, b"content-length")
        self.declared = int(length) if length is not None and length.strip().isdigit() else None
        if self.declared is not None and self.declared > cap:
            raise too_big()  # refused before a byte of the body is read
        self._chunks, self._cap, self._too_big = response.iter_stream(), cap, too_big
        self._buffer, self._seen = bytearray(), 0

    def _more(self) -> bool:
        chunk = next(self._chunks, None)
        self._seen += len(chunk or b"")
        if self._seen > self._cap:  # stops at the first chunk past the cap, whatever was declared
            raise self._too_big()
        self._buffer += chunk or b""
        return chunk is not None

    def read(self, n: int) -> bytes:  # fewer only where the body ends
        while len(self._buffer) < n and self._more():
            pass
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def chunks(self) -> Iterator[bytes]:
        while self._buffer or self._more():
            out = bytes(self._buffer)
            self._buffer.clear()
            yield out


def _safetensors_head(body: _Body, cap: int, shown: str, adapter_id: str) -> bytes:
    """The 8-byte header length and the JSON header, checked before the rest is read."""
    head = streamed_header(body.read, cap, adapter_id, cap)
    if head is None:
        raise AdapterInvalid(adapter_id, f"{shown} is not a safetensors file (its first bytes are no header)",
                             "Give the URL of a .safetensors file (pickled .ckpt, .pt and .bin files are never loaded)")
    return head


def _safe_id(adapter_id: str) -> str:
    return display_url(adapter_id) if "://" in adapter_id else adapter_id  # an id that is a URL keeps no token


def _fetch(url: str, rules: FetchRules, adapter_id: str, headers: dict[str, str],
           consume: Callable[[httpcore.Response, str], object]):
    """GET `url` under `rules`; `consume(response, shown URL)` reads the final answer's body."""
    # httpx's own TLS context (certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR when set), one per
    # fetch as httpcore sets ALPN on it; a pool per fetch, so no connection outlives its checks
    pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(),
                                   network_backend=CheckedBackend(rules.allow, adapter_id,
                                                                  _deadline(rules)))
    with pool, _upstream_errors(url, rules, adapter_id):
        response, final = _open(pool, url, rules, adapter_id, headers)
        try:
            _check_status(response, display_url(str(final)), adapter_id)
            return consume(response, display_url(str(final)))
        finally:
            response.close()  # bytes left unread: the connection is dropped, the upstream stops sending


def _deadline(rules: FetchRules) -> float:
    return rules.deadline if rules.deadline is not None else time.monotonic() + rules.total_timeout


def _write(response: httpcore.Response, shown: str, dest: Path, rules: FetchRules, adapter_id: str,
           safetensors: bool, reserve: Reserve) -> Fetched:
    body = _Body(response, rules.max_bytes, lambda: AdapterInvalid(
        adapter_id, f"{shown} is larger than {rules.max_bytes} bytes",
        "Start the server with a larger --max-adapter-mb if a file this big is meant to be served"))
    digest = hashlib.sha256()
    head = _safetensors_head(body, rules.max_bytes, shown, adapter_id) if safetensors else b""
    with dest.open("wb") as out:
        if body.declared is not None:
            reserve(body.declared, 0)  # the whole file's room, before its body is read
        for chunk in itertools.chain([head] if head else [], body.chunks()):
            reserve(out.tell() + len(chunk), RESERVE_AHEAD)  # a body longer than declared, or of no length
            out.write(chunk)
            digest.update(chunk)
        size = out.tell()
        out.truncate()  # what was reserved past the end
    return Fetched(dest, size, digest.hexdigest(), _header(response, b"etag"), shown)


def fetch_file(url: str, dest: Path, rules: FetchRules, adapter_id: str, headers: dict[str, str] | None = None,
               safetensors: bool = True, reserve: Reserve | None = None) -> Fetched:
    """GET `url` into `dest` (the caller's temporary path, deleted on any failure) under `rules`;
    `reserve(bytes, more)` is told the file's size before those bytes are written (the download
    cache's budget)."""
    adapter_id = _safe_id(adapter_id)
    reserve = reserve or (lambda total, ahead: None)
    try:
        fetched = _fetch(url, rules, adapter_id, headers or {}, lambda response, shown: _write(
            response, shown, dest, rules, adapter_id, safetensors, reserve))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    logger.info("fetched %s for %s: %d B", fetched.final_url, adapter_id, fetched.size)
    return fetched


def fetch_json(url: str, rules: FetchRules, adapter_id: str, headers: dict[str, str] | None = None,
               max_bytes: int = 4 * 2**20) -> object:
    """GET `url` and parse its JSON answer (at most `max_bytes`), under `rules`."""
    adapter_id = _safe_id(adapter_id)

    def parse(response: httpcore.Response, shown: str) -> object:
        fix = "Check that the URL is the API's (e.g. --civitai-api)"
        body = _Body(response, max_bytes, lambda: AdapterInvalid(adapter_id, f"{shown} is over {max_bytes} B", fix))
        try:
            return json.loads(b"".join(body.chunks()))
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's depth
            raise AdapterInvalid(adapter_id, f"{shown} did not answer JSON", fix) from None
    return _fetch(url, rules, adapter_id, {"Accept": "application/json", **(headers or {})}, parse)
