"""Files elsewhere: by URL (`--url-allow`, `url.py`), from Civitai (`--civitai`, `civitai.py`)
and from S3 buckets (`--s3`, `s3.py`), each off until its flag turns it on, and refused with
a 403 naming that flag.

They share one download folder (`downloads.py`): a fetched file lands there and is read
from there like a file of the adapter folder. Each time one is named, cached or not, it
passes this server's flags and rules (another server sharing the folder may have fetched it
under other ones). Fetching itself, with its network rules (allowed hosts, no private
addresses, redirects re-checked, timeouts, the size cap, the safetensors header first), is
`fetch.py`'s; reading a bucket, `s3.py`'s.
"""

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.reference import AdapterRef, check_id, source_of
from loraswap.adapters.sources.civitai import fetch_civitai
from loraswap.adapters.sources.download_waits import asked_at
from loraswap.adapters.sources.downloads import Download, DownloadCache, Reserve
from loraswap.adapters.sources.fetch import FetchRules
from loraswap.adapters.sources.url import UrlChecks, fetch_url, url_to_check
from loraswap.errors import AdapterForbidden, LoraswapError

ENABLED_BY = {"url": "--url-allow HOST", "civitai": "--civitai", "s3": "--s3"}


@dataclass(frozen=True)
class RemoteSettings:
    url_allow: tuple[str, ...] = ()  # hosts URLs may name (fetch.py's patterns); none: URLs refused
    civitai_api: str | None = None  # Civitai's API base; None: Civitai refused
    civitai_token: str | None = None
    s3: bool = False  # buckets, with the standard AWS settings
    s3_endpoint_url: str | None = None  # an S3-compatible store (MinIO, R2, ...)
    max_bytes: int = 2 * 2**30
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    total_timeout: float = 600.0  # one download, start to end

    def __repr__(self) -> str:  # a config printed or logged never shows the token
        return (f"RemoteSettings(url_allow={self.url_allow}, civitai_api={self.civitai_api!r}, "
                f"civitai_token={'set' if self.civitai_token else None})")


class RemoteSources:
    def __init__(self, settings: RemoteSettings, download_dir: Path, download_bytes: int):
        self.settings = settings
        self._download_dir, self._download_bytes = download_dir, download_bytes
        self._downloads: DownloadCache | None = None
        self._downloads_lock = threading.Lock()
        self.url_checks = UrlChecks(lambda: self._rules(settings.url_allow, math.inf))

    @property
    def downloads(self) -> DownloadCache:
        """The download folder, made when first needed (a server that fetches nothing has none):
        one per server, however many requests first need it at once (each cache has its own
        fetches in flight, which the requests of one adapter must share)."""
        with self._downloads_lock:
            if self._downloads is None:
                self._downloads = DownloadCache(self._download_dir, self._download_bytes)
            return self._downloads

    def list_ids(self) -> list[str]:
        """The adapters downloaded that this server may serve (they survive a restart, and other
        servers sharing the folder may have fetched them under other rules)."""
        if self._downloads is None and not self._download_dir.is_dir():
            return []
        return [record["id"] for record in self.downloads.records() if self._may_serve(record)]

    def evict(self, adapter_id: str) -> None:
        """Drop the adapter's download (`DELETE /adapters/{id}`, or a file refused when read); it is
        fetched again when next named."""
        if self._downloads is not None or self._download_dir.is_dir():
            self.downloads.remove(adapter_id)

    def has(self, adapter_id: str) -> bool:
        """Whether the adapter's file is in the download folder (not whether this server may serve
        it); before the folder is first used, False. A look, no more: the event loop may ask."""
        return self._downloads is not None and self._downloads.has(adapter_id)

    def may_wait(self, ref: AdapterRef) -> bool:
        """Whether finding the adapter may wait on the network: its file is not in the download
        folder yet, or it is a URL's whose host is due to be resolved again (`url.UrlChecks`). A
        look, no more: the event loop asks."""
        if not self.has(ref.adapter_id):
            return True
        return ref.source == "url" and self.url_checks.due(ref.adapter_id)

    def deadline(self) -> float:
        """When a fetch for the current request must end: --download-timeout-s after it asked
        (`download_waits.asked_at`: on the fetch pool, when it entered it)."""
        return asked_at() + self.settings.total_timeout

    def locate(self, ref: AdapterRef) -> AdapterLocation:
        """The adapter's file in the download cache, fetched first if it is not there. Its reference
        passes this server's source flags and address rules each time, cached or not; the fetch,
        waits for it included, ends within --download-timeout-s of the request's asking."""
        adapter_id, source = ref.adapter_id, ref.source
        self._check_enabled(adapter_id, source)
        deadline = self.deadline()
        if source == "url":
            self.url_checks.check(url_to_check(ref, self.downloads), adapter_id)
        accept = self.same_origin(source)
        found = self.downloads.path(adapter_id, accept) or self.downloads.fetch(
            adapter_id, lambda dest, reserve: self._fetch(ref, dest, reserve, deadline), deadline, accept)
        record = self.downloads.record(adapter_id) or {}
        return AdapterLocation(adapter_id, found, None, source_says=record.get("base_model"))

    def _check_enabled(self, adapter_id: str, source: str) -> None:
        enabled = {"url": bool(self.settings.url_allow), "civitai": self.settings.civitai_api is not None,
                   "s3": self.settings.s3}
        if not enabled.get(source, False):
            raise AdapterForbidden(adapter_id, f"this server does not fetch adapters from {source} references",
                                   f"Start it with {ENABLED_BY[source]} (docs/adapters.md)")

    def same_origin(self, source: str) -> Callable[[dict], bool]:
        """Whether a download's record says it came through the API or store this server uses
        (Civitai's API, the S3 endpoint), as `downloads.path` and `fetch` take it (`accept`): one
        that came through another is fetched again through this server's own."""
        origin = self._origin(source)
        return lambda record: record.get("origin") == origin

    def _origin(self, source: str) -> str | None:
        if source == "civitai":
            return self.settings.civitai_api.rstrip("/")
        return (self.settings.s3_endpoint_url or "aws") if source == "s3" else None

    def _may_serve(self, record: dict) -> bool:
        """Whether a download's record passes this server's source flags and rules (for listing)."""
        try:
            adapter_id = check_id(record["id"])
            source = source_of(adapter_id)
            self._check_enabled(adapter_id, source)
            if source == "url":
                self.url_checks.check(record["shown"], adapter_id)
                return True
            return self.same_origin(source)(record)
        except (LoraswapError, KeyError, TypeError):
            return False

    def _fetch(self, ref: AdapterRef, dest: Path, reserve: Reserve, deadline: float) -> Download:
        """The ref's file written to `dest`, the way its kind is fetched."""
        if ref.source == "civitai":
            s = self.settings
            return fetch_civitai(ref, dest, reserve, self._origin("civitai"), s.civitai_token,
                                 lambda allow: self._rules(allow, deadline))
        if ref.source == "s3":
            return self._fetch_s3(ref, dest, reserve, deadline)
        return fetch_url(ref, dest, reserve, self._rules(self.settings.url_allow, deadline))

    def _rules(self, allow: tuple[str, ...], deadline: float) -> FetchRules:
        """The fetch rules, the fetch ending at `deadline` (waits for it included)."""
        s = self.settings
        return FetchRules(allow=allow, max_bytes=s.max_bytes, connect_timeout=s.connect_timeout,
                          read_timeout=s.read_timeout, total_timeout=s.total_timeout,
                          deadline=deadline if deadline < math.inf else None)

    def _fetch_s3(self, ref: AdapterRef, dest: Path, reserve: Reserve, deadline: float) -> Download:
        # boto3 is imported here, not at start-up: it costs ~0.3 s to import and only `--s3` needs it
        from loraswap.adapters.sources.s3 import S3Settings, fetch_s3
        s, reference = self.settings, ref.where
        settings = S3Settings(endpoint_url=s.s3_endpoint_url, max_bytes=s.max_bytes,
                              connect_timeout=s.connect_timeout, read_timeout=s.read_timeout,
                              total_timeout=s.total_timeout)
        _, sha256 = fetch_s3(reference.bucket, reference.key, dest, settings, ref.adapter_id, deadline, reserve)
        return Download("s3", f"s3://{reference.bucket}/{reference.key}", sha256, origin=self._origin("s3"))
