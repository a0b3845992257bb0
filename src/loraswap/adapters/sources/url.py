"""Adapters named by URL (`--url-allow HOST`): `url:<hash>` ids, whose URL travels in the ref.

Each time such an adapter is named, cached or not, its URL passes this server's rules (its
host's patterns, plain http, the addresses its name resolves to: `fetch.check_url`); the
answer is trusted a minute (`UrlChecks`), so a cached adapter named on every request has its
host resolved once a minute, not once a request. Without the URL (an id whose URL the
server no longer knows), the rules judge where its download's record says it came from. The
file itself is fetched by `fetch.fetch_file` into the download folder (`remote.RemoteSources`).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.downloads import Download, DownloadCache, Reserve
from loraswap.adapters.sources.fetch import FetchRules, check_url, display_url, fetch_file
from loraswap.errors import AdapterError, AdapterNotFound

VERDICT_S = 60.0  # how long a URL's check (its host resolved) is trusted for a file already here
MAX_VERDICTS = 4096  # checks kept; past it, all are forgotten


@dataclass(frozen=True)
class _UrlVerdict:
    """`check_url`'s answer for a URL adapter, trusted until `until`: the refusal as its class and
    arguments (a new exception is raised from them each time), or None when the URL is allowed."""

    shown: str  # the URL judged, as `display_url` shows it
    until: float  # a `time.monotonic()` instant
    refusal: tuple[type[AdapterError], str, str, str] | None  # (class, adapter id, problem, fix)


class UrlChecks:
    """The URL rules' answers, by adapter id, each trusted `VERDICT_S`; `rules()` gives the
    rules to judge by (the server's allowed hosts, no deadline)."""

    def __init__(self, rules: Callable[[], FetchRules]):
        self._rules = rules
        self._verdicts: dict[str, _UrlVerdict] = {}  # url: id -> its URL's last check

    def check(self, url: str, adapter_id: str) -> None:
        """`check_url`, its answer trusted a minute; a refusal is raised anew each time."""
        verdict, now = self._verdicts.get(adapter_id), time.monotonic()
        if verdict is None or verdict.until <= now or verdict.shown != display_url(url):
            verdict = self._judge(url, adapter_id, now)
        if verdict.refusal is not None:
            kind, *parts = verdict.refusal
            raise kind(*parts)

    def due(self, adapter_id: str) -> bool:
        """Whether the id's URL is due to be checked again (its host resolved: a wait on the network)."""
        verdict = self._verdicts.get(adapter_id)
        return verdict is None or verdict.until <= time.monotonic()

    def _judge(self, url: str, adapter_id: str, now: float) -> _UrlVerdict:
        try:
            check_url(url, self._rules(), adapter_id)
            refusal = None
        except AdapterError as e:
            refusal = (type(e), e.adapter_id, e.problem, e.fix)
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts.clear()
        verdict = self._verdicts[adapter_id] = _UrlVerdict(display_url(url), now + VERDICT_S, refusal)
        return verdict


def url_to_check(ref: AdapterRef, downloads: DownloadCache) -> str:
    """The URL the rules judge: the ref's, else where its download's record says it came from;
    404 when neither is known (an id whose URL the server no longer knows, not downloaded)."""
    url = ref.url if ref.url is not None else (downloads.record(ref.adapter_id) or {}).get("shown")
    if url is None:
        raise AdapterNotFound(ref.adapter_id, "its download is no longer cached", "Name it by its URL again")
    return url


def fetch_url(ref: AdapterRef, dest: Path, reserve: Reserve, rules: FetchRules) -> Download:
    """The ref's file written to `dest`, under `rules` (ending at their deadline)."""
    if ref.url is None:  # a url: id whose URL this server no longer knows, and not on disk
        raise AdapterNotFound(ref.adapter_id, "its download is no longer cached", "Name it by its URL again")
    fetched = fetch_file(ref.url, dest, rules, ref.adapter_id, reserve=reserve)
    return Download("url", display_url(ref.url), fetched.sha256)

