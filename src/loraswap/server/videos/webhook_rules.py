"""Where a webhook may be sent.

A job's `webhook_url` is a user's URL, so it meets the rules an adapter's URL does
(`adapters/sources/fetch.py`), with patterns of its own (`--webhook-allow`, `host` or `host:port`,
fnmatch; `*` any public host): http or https to a host a pattern allows, plain http only to
a host a pattern names without a wildcard, no user name or password in it; loopback,
private, link-local, multicast, reserved, CGNAT and cloud-metadata addresses only when a
pattern names that host or IP literally. Checked when the job is made (`check_webhook_url`,
400 naming the rule): the URL's text, and the address it writes (an IP, `localhost`), with
no DNS lookup, which would hold a request thread for as long as a resolver takes; and again
at every delivery (`checked_url`), where the name's addresses are checked as the socket
opens (`adapters.addresses.CheckedBackend`), the lookup within the try's time.

A URL's path and query often hold the receiver's token (Slack's, Discord's, Zapier's): a
log shows a webhook URL only as `origin` (scheme, host, port) beside the webhook's id; the
client that gave it may see it whole.
"""


import httpx

from loraswap.adapters.sources.addresses import address_kind, allowed_host, named
from loraswap.adapters.sources.fetch import display_url
from loraswap.errors import BadRequest
from loraswap.server.config import WebhookConfig

MAX_URL_CHARS = 2048


class WebhookRefused(BadRequest):
    """A webhook URL this server does not send to; the message names the rule and the flag."""


def origin(url: str) -> str:
    """scheme://host[:port] of a URL: all of a webhook URL a log shows (no path, no query, no
    user name or password)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an unparseable URL)"
    return f"{parsed.scheme}://{parsed.netloc.decode('ascii')}"[:200]


def _port(url: httpx.URL) -> int:
    return url.port or {"https": 443, "http": 80}.get(url.scheme, 0)


def checked_url(url: str, allow: list[str] | tuple[str, ...], shown: str | None = None) -> httpx.URL:
    """The URL, parsed, if the rules on its text allow it (its addresses are checked apart);
    WebhookRefused naming the rule otherwise, the URL written as `shown` (default: without its
    query, for the client that gave it)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise WebhookRefused("webhook_url could not be parsed: give an https:// URL") from None
    host, port, shown = parsed.raw_host.decode("ascii"), _port(parsed), shown or display_url(url)
    if parsed.scheme not in ("https", "http") or not host or not 0 < port < 2**16:
        raise WebhookRefused(f"webhook_url {shown}: only http(s)://HOST[:PORT] URLs are called")
    if parsed.userinfo:
        raise WebhookRefused(f"webhook_url {shown}: the URL carries a user name or password; leave it out (a "
                             "receiver checks the webhook-signature header instead)")
    if not allowed_host(host, port, tuple(allow)):
        raise WebhookRefused(f"webhook_url {shown}: host {host} is not allowed; start the server with "
                             f"--webhook-allow {host}")
    if parsed.scheme == "http" and not named(host, port, tuple(allow)):
        raise WebhookRefused(f"webhook_url {shown}: plain http is called only on a host --webhook-allow names "
                             f"without a wildcard (e.g. --webhook-allow {host}:{port}); give an https:// URL")
    return parsed


def check_written_address(url: httpx.URL, allow: list[str] | tuple[str, ...]) -> None:
    """WebhookRefused when the URL's host is an address the rules keep out (loopback, private,
    metadata, ... not named by a pattern), as written: an IP, or `localhost` (a loopback name
    everywhere). No DNS lookup: a name's addresses are checked as each try connects."""
    host, port = url.raw_host.decode("ascii"), _port(url)
    if named(host, port, tuple(allow)):
        return
    try:
        kind = address_kind(host)
    except ValueError:  # a name
        kind = "loopback" if host.rstrip(".").lower().split(".")[-1] == "localhost" else None
    if kind is not None:
        raise WebhookRefused(f"webhook_url {display_url(str(url))}: {host} is a {kind} address; start the server "
                             f"with --webhook-allow {host} if it is meant to be called (such addresses only when a "
                             "pattern names the host or IP, not a wildcard)")


def check_webhook_url(url: str, config: WebhookConfig) -> None:
    """What a job asking for a webhook at `url` is refused for (400), before it is made: no
    secret to sign with, a URL past the rules (its text; no DNS lookup)."""
    if config.secret is None:
        raise BadRequest("webhook_url: this server has no webhook secret to sign webhooks with; start it with "
                         "--webhook-secret whsec_... (or LORASWAP_WEBHOOK_SECRET)")
    if len(url) > MAX_URL_CHARS:
        raise WebhookRefused(f"webhook_url is {len(url)} characters; the most is {MAX_URL_CHARS}")
    check_written_address(checked_url(url, config.allow), config.allow)
