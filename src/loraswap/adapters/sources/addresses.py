"""Which addresses a fetch may open a socket to, checked as it opens (no DNS-rebinding window),
and the fetch's deadline held on every read of that socket.

A host must match a `--url-allow` pattern (`host` or `host:port`, fnmatch; `*` any public
host). Loopback, private, link-local, multicast, reserved, CGNAT and cloud-metadata
addresses are reached only when a pattern names that host or IP literally. `CheckedBackend`
is httpcore's network backend with those checks: it resolves, checks and connects to the IP,
while TLS still verifies and sends SNI for the name.
"""

import fnmatch
import ipaddress
import socket
import time
from collections.abc import Callable
from contextlib import suppress

import httpcore

from loraswap.errors import AdapterForbidden

_METADATA = frozenset(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")))
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # CGNAT; Alibaba's metadata (100.100.100.200) lives there
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # reaches the IPv4 address in its low 32 bits
_KINDS = (("cloud-metadata", lambda a: a in _METADATA), ("loopback", lambda a: a.is_loopback),
          ("unspecified", lambda a: a.is_unspecified), ("link-local", lambda a: a.is_link_local),
          ("multicast", lambda a: a.is_multicast), ("shared (CGNAT)", lambda a: a in _SHARED),
          ("private", lambda a: a.is_private), ("reserved", lambda a: a.is_reserved))


def _names(host: str, port: int) -> set[str]:
    host = host.lower()
    bracketed = f"[{host}]" if ":" in host else host  # an IPv6 literal with a port: [::1]:8443
    return {host, bracketed, f"{bracketed}:{port}"}


def allowed_host(host: str, port: int, allow: tuple[str, ...]) -> bool:
    """Whether a pattern matches `host` or `host:port` (names only; addresses are checked at connect)."""
    names = _names(host, port)
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in map(str.lower, allow) for name in names)


def named(host: str, port: int, allow: tuple[str, ...]) -> bool:
    """Whether a pattern names this host (or IP) literally: no wildcard, so `*` never does."""
    names = _names(host, port)
    return any(p.lower() in names for p in allow if not any(c in p for c in "*?["))


def _judged(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple:
    """What decides: a mapped or NAT64 address's IPv4 one (where it goes); 6to4 and Teredo, both."""
    if addr.version == 4:
        return (addr,)
    if addr.ipv4_mapped or addr in _NAT64:
        return (addr.ipv4_mapped or ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF),)
    embedded = addr.sixtofour or (addr.teredo or (None, None))[1]
    return (embedded, addr) if embedded else (addr,)


def address_kind(ip: str) -> str | None:
    """Why `ip` is no public address ('loopback', 'cloud-metadata', ...); None when it is one."""
    for candidate in _judged(ipaddress.ip_address(ip)):
        kind = next((kind for kind, test in _KINDS if test(candidate)), None)
        if kind or not candidate.is_global:
            return kind or "non-public"
    return None


def system_lookup(host: str, port: int) -> list[tuple]:
    """`socket.getaddrinfo`'s answer for a TCP connection to `host`: no timeout of its own,
    the system resolver's."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


Lookup = Callable[[str, int], list[tuple]]  # (host, port) -> getaddrinfo's answer


def usable_addresses(host: str, port: int, allow: tuple[str, ...], adapter_id: str,
                     lookup: Lookup = system_lookup) -> list[str]:
    """The addresses of `host` a fetch may connect to, resolved by `lookup`; AdapterForbidden
    when none may be, and httpcore.ConnectError when the name does not resolve."""
    try:
        infos = lookup(host, port)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a label IDNA cannot encode (empty, over 63 characters)
        raise httpcore.ConnectError(f"{host} did not resolve: {exc}") from exc
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    by_name = named(host, port, allow)
    usable = [ip for ip in ips if by_name or named(ip, port, allow) or address_kind(ip) is None]
    if not usable:
        raise AdapterForbidden(adapter_id, f"{host} resolves to {ips[0]}, a {address_kind(ips[0])} address",
                               f"Start the server with --url-allow {host}:{port} if it is meant to be reached "
                               "(such addresses only when a pattern names the host or IP, not a wildcard)")
    return usable


class Overdue(httpcore.ReadTimeout):
    """The fetch's deadline passed: its host sent steadily, but too slowly to finish in time."""


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every read and write waits at most until the deadline, whatever the
    per-read timeout: a host dripping a byte per read timeout, headers included, is cut off."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float):
        self._stream, self._deadline = stream, deadline

    def _bounded(self, call, timeout: float | None):
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise Overdue("the fetch's deadline passed")
        try:
            return call(left if timeout is None else min(timeout, left))
        except httpcore.TimeoutException:
            if time.monotonic() >= self._deadline:
                raise Overdue("the fetch's deadline passed") from None
            raise

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._bounded(lambda t: self._stream.read(max_bytes, t), timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._bounded(lambda t: self._stream.write(buffer, t), timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        tls = self._bounded(lambda t: self._stream.start_tls(ssl_context, server_hostname, t), timeout)
        return _DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class CheckedBackend(httpcore.SyncBackend):
    """Opens sockets only to addresses the rules allow, checked as it connects (no rebinding
    window), each held to the fetch's `deadline` (a `time.monotonic()` instant)."""

    def __init__(self, allow: tuple[str, ...], adapter_id: str, deadline: float, lookup: Lookup = system_lookup):
        self._allow, self._adapter_id, self._deadline, self._lookup = allow, adapter_id, deadline, lookup

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        left = self._deadline - time.monotonic()
        if left <= 0:  # a redirect after the deadline, say
            raise Overdue("the fetch's deadline passed")
        try:
            stream = self._connect(host, port, left if timeout is None else min(timeout, left), local_address,
                                   socket_options)
        except httpcore.ConnectTimeout:
            if time.monotonic() >= self._deadline:
                raise Overdue("the fetch's deadline passed") from None
            raise
        return _DeadlineStream(stream, self._deadline)

    def _connect(self, host, port, timeout, local_address, socket_options):
        usable = usable_addresses(host, port, self._allow, self._adapter_id, self._lookup)
        for ip in usable[:-1]:  # the IP, never the name again: what was checked is what is connected to
            with suppress(httpcore.ConnectError, httpcore.ConnectTimeout):
                return super().connect_tcp(ip, port, timeout, local_address, socket_options)
        return super().connect_tcp(usable[-1], port, timeout, local_address, socket_options)


