"""Adapters fetched from elsewhere: by URL (`--url-allow`), from Civitai (`--civitai`) and
from S3 buckets (`--s3`), each source off until its flag turns it on, and refused with a
403 naming that flag.

A fetched file lands in the download cache (`downloads.py`) and is read from there like a
file of the adapter folder. Fetching itself, with its network rules (allowed hosts, no
private addresses, redirects re-checked, timeouts, the size cap, the safetensors header
first), is `fetch.py`'s; reading a bucket, `s3.py`'s.

Civitai: `GET {api}/v1/model-versions/{VERSION}` names the version's files; the primary
SafeTensor file of type Model is downloaded and must match the SHA256 Civitai lists. A
token (`CIVITAI_TOKEN`, or `--civitai-token-file`) goes with both requests as a Bearer
header, never into a URL, a log or an error.
"""

import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from loraswap.adapters.naming.references import (
    CivitaiReference,
    S3Reference,
    check_id,
    is_remote,
    reference_of,
    source_of,
)
from loraswap.adapters.sources.download_waits import asked_at
from loraswap.adapters.sources.downloads import Download, DownloadCache, Reserve
from loraswap.adapters.sources.fetch import FetchRules, check_url, display_url, fetch_file, fetch_json
from loraswap.adapters.sources.local import AdapterLocation
from loraswap.errors import (
    AdapterError,
    AdapterForbidden,
    AdapterInvalid,
    AdapterNotFound,
    AdapterUnavailable,
    LoraswapError,
)

CIVITAI_API = "https://civitai.com/api"
ENABLED_BY = {"url": "--url-allow HOST", "civitai": "--civitai", "s3": "--s3"}
VERDICT_S = 60.0  # how long a URL's check (its host resolved) is trusted for a file already here
MAX_VERDICTS = 4096  # checks kept; past it, all are forgotten


@dataclass(frozen=True)
class _UrlVerdict:
    """`check_url`'s answer for a URL adapter, trusted until `until`: the refusal as its class and
    arguments (a new exception is raised from them each time), or None when the URL is allowed."""

    shown: str  # the URL judged, as `display_url` shows it
    until: float  # a `time.monotonic()` instant
    refusal: tuple[type[AdapterError], str, str, str] | None  # (class, adapter id, problem, fix)


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
        self._verdicts: dict[str, _UrlVerdict] = {}  # url: id -> its URL's last check (`_check_url`)

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

    def forget(self, adapter_id: str) -> None:
        """Drop the adapter's download (`DELETE /adapters/{id}`, or a file refused when read); it is
        fetched again when next named."""
        if self._downloads is not None or self._download_dir.is_dir():
            self.downloads.remove(adapter_id)

    def handles(self, adapter_id: str) -> bool:
        return is_remote(adapter_id)

    def has(self, adapter_id: str) -> bool:
        """Whether the adapter's file is in the download folder (not whether this server may serve
        it); before the folder is first used, False. A look, no more: the event loop may ask."""
        return self._downloads is not None and self._downloads.has(adapter_id)

    def may_wait(self, adapter_id: str) -> bool:
        """Whether finding the adapter may wait on the network: its file is not in the download
        folder yet, or it is a URL's whose host is due to be resolved again (`_check_url`). A look,
        no more: the event loop asks."""
        if not self.has(adapter_id):
            return True
        verdict = self._verdicts.get(adapter_id)
        return source_of(adapter_id) == "url" and (verdict is None or verdict.until <= time.monotonic())

    def deadline(self) -> float:
        """When a fetch for the current request must end: --download-timeout-s after it asked
        (`download_waits.asked_at`: on the fetch pool, when it entered it)."""
        return asked_at() + self.settings.total_timeout

    @staticmethod
    def source_of(adapter_id: str) -> str:
        """url, civitai or s3."""
        return source_of(adapter_id)

    def locate(self, adapter_id: str) -> AdapterLocation:
        """The adapter's file in the download cache, fetched first if it is not there. Its reference
        passes this server's source flags and address rules each time, cached or not; the fetch,
        waits for it included, ends within --download-timeout-s of the request's asking."""
        check_id(adapter_id)
        source = source_of(adapter_id)
        self._check_enabled(adapter_id, source)
        deadline = self.deadline()
        self._check_url(adapter_id, source)
        accept = self._same_origin(source)
        found = self.downloads.path(adapter_id, accept) or self.downloads.fetch(
            adapter_id, lambda dest, reserve: self._fetch(adapter_id, source, dest, reserve, deadline), deadline,
            accept)
        record = self.downloads.record(adapter_id) or {}
        return AdapterLocation(adapter_id, found, None, source_says=record.get("base_model"))

    def _check_enabled(self, adapter_id: str, source: str) -> None:
        enabled = {"url": bool(self.settings.url_allow), "civitai": self.settings.civitai_api is not None,
                   "s3": self.settings.s3}
        if not enabled.get(source, False):
            raise AdapterForbidden(adapter_id, f"this server does not fetch adapters from {source} references",
                                   f"Start it with {ENABLED_BY[source]} (docs/adapters.md)")

    def _check_url(self, adapter_id: str, source: str) -> None:
        """A URL's: the rules a fetch of it would meet (its host's patterns, plain http, the
        addresses its name resolves to), whether or not its file is already here. Without the
        URL (an id whose URL this process never saw), where its record says it came from."""
        if source != "url":
            return
        reference = reference_of(adapter_id)
        url = reference.url if reference is not None else (self.downloads.record(adapter_id) or {}).get("shown")
        if url is None:
            raise AdapterNotFound(adapter_id, "its download is no longer cached", "Name it by its URL again")
        self._check_url_cached(url, adapter_id)

    def _check_url_cached(self, url: str, adapter_id: str) -> None:
        """`check_url`, its answer trusted a minute: a cached adapter named on every request has
        its host resolved once a minute, not once a request. A refusal is raised anew each time."""
        verdict, now = self._verdicts.get(adapter_id), time.monotonic()
        if verdict is None or verdict.until <= now or verdict.shown != display_url(url):
            verdict = self._judge(url, adapter_id, now)
        if verdict.refusal is not None:
            kind, *parts = verdict.refusal
            raise kind(*parts)

    def _judge(self, url: str, adapter_id: str, now: float) -> _UrlVerdict:
        try:
            check_url(url, self._rules(self.settings.url_allow, math.inf), adapter_id)
            refusal = None
        except AdapterError as e:
            refusal = (type(e), e.adapter_id, e.problem, e.fix)
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts.clear()
        verdict = self._verdicts[adapter_id] = _UrlVerdict(display_url(url), now + VERDICT_S, refusal)
        return verdict

    def _same_origin(self, source: str) -> Callable[[dict], bool]:
        """Whether a download came through the API or store this server uses (Civitai's API, the
        S3 endpoint): one that came through another is fetched again through this server's own."""
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
                self._check_url_cached(record["shown"], adapter_id)
                return True
            return self._same_origin(source)(record)
        except (LoraswapError, KeyError, TypeError):
            return False

    def _fetch(self, adapter_id: str, source: str, dest: Path, reserve: Reserve, deadline: float) -> Download:
        reference = reference_of(adapter_id)
        if reference is None:  # a url: id whose URL this process never saw, and not on disk
            raise AdapterNotFound(adapter_id, "its download is no longer cached", "Name it by its URL again")
        if isinstance(reference, CivitaiReference):
            return self._fetch_civitai(adapter_id, reference, dest, reserve, deadline)
        if isinstance(reference, S3Reference):
            return self._fetch_s3(adapter_id, reference, dest, reserve, deadline)
        rules = self._rules(self.settings.url_allow, deadline)
        fetched = fetch_file(reference.url, dest, rules, adapter_id, reserve=reserve)
        return Download(source, display_url(reference.url), fetched.sha256)

    def _rules(self, allow: tuple[str, ...], deadline: float) -> FetchRules:
        """The fetch rules, the fetch ending at `deadline` (waits for it included)."""
        s = self.settings
        return FetchRules(allow=allow, max_bytes=s.max_bytes, connect_timeout=s.connect_timeout,
                          read_timeout=s.read_timeout, total_timeout=s.total_timeout,
                          deadline=deadline if deadline < math.inf else None)

    def _fetch_s3(self, adapter_id: str, reference: S3Reference, dest: Path, reserve: Reserve,
                  deadline: float) -> Download:
        # boto3 is imported here, not at start-up: it costs ~0.3 s to import and only `--s3` needs it
        from loraswap.adapters.sources.s3 import S3Settings, fetch_s3
        s = self.settings
        settings = S3Settings(endpoint_url=s.s3_endpoint_url, max_bytes=s.max_bytes,
                              connect_timeout=s.connect_timeout, read_timeout=s.read_timeout,
                              total_timeout=s.total_timeout)
        _, sha256 = fetch_s3(reference.bucket, reference.key, dest, settings, adapter_id, deadline, reserve)
        return Download("s3", f"s3://{reference.bucket}/{reference.key}", sha256, origin=self._origin("s3"))

    # ---------------------------------------------------------------- Civitai
    def _fetch_civitai(self, adapter_id: str, reference: CivitaiReference, dest: Path, reserve: Reserve,
                       deadline: float) -> Download:
        api = self._origin("civitai")
        # the API's own host is named, so a mirror on a private network works; its download
        # links may redirect to any public host (Civitai's storage)
        allow = ("*", _host_pattern(api))
        headers = {"Authorization": f"Bearer {self.settings.civitai_token}"} if self.settings.civitai_token else {}
        version = fetch_json(f"{api}/v1/model-versions/{reference.version}", self._rules(allow, deadline), adapter_id,
                             headers)
        _check_civitai_answer(adapter_id, version)
        file = _primary_file(adapter_id, reference, version)
        fetched = fetch_file(file["downloadUrl"], dest, self._rules(allow, deadline), adapter_id, headers,
                             reserve=reserve)
        expected = (file.get("hashes") or {}).get("SHA256") or ""
        if fetched.sha256.lower() != expected.lower():
            raise AdapterInvalid(adapter_id, f"the file downloaded does not match the SHA256 Civitai lists "
                                 f"({expected[:12] or 'none'}...)", "Try again later, or report it to Civitai")
        return Download("civitai", display_url(file["downloadUrl"]), fetched.sha256, version.get("baseModel"), api)


# what is read of Civitai's answer, and the JSON type each must have when present (a model
# version: `GET /v1/model-versions/{id}`)
CIVITAI_VERSION_FIELDS = {"files": list, "modelId": int, "baseModel": str}
CIVITAI_FILE_FIELDS = {"type": str, "primary": bool, "downloadUrl": str, "metadata": dict, "hashes": dict}
CIVITAI_INNER_FIELDS = {"metadata": {"format": str}, "hashes": {"SHA256": str}}
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def _check_civitai_answer(adapter_id: str, version: object) -> None:
    """502 naming the field of Civitai's answer that is not of the type it must be (`hashes.SHA256`
    a number, `files` an object, ...): its upstream answered wrong, not the client."""
    _check_fields(adapter_id, version, CIVITAI_VERSION_FIELDS, "")
    if version.get("files") is None:
        raise _malformed(adapter_id, "it has no files list")
    for i, file in enumerate(version["files"]):
        _check_fields(adapter_id, file, CIVITAI_FILE_FIELDS, f"files[{i}]")
        for name, fields in CIVITAI_INNER_FIELDS.items():
            _check_fields(adapter_id, file.get(name) or {}, fields, f"files[{i}].{name}")
        sha256 = (file.get("hashes") or {}).get("SHA256")
        if sha256 is not None and not SHA256_HEX.fullmatch(sha256):
            raise _malformed(adapter_id, f"files[{i}].hashes.SHA256 is {_described(sha256)}, not 64 hex digits")


def _check_fields(adapter_id: str, value: object, fields: dict[str, type], where: str) -> None:
    """`value` (the object at `where`; "": the answer) is an object whose `fields` are absent,
    null or of their type."""
    if not isinstance(value, dict):
        raise _malformed(adapter_id, f"{where or 'it'} is {_described(value)}, not an object")
    for name, kind in fields.items():
        field = value.get(name)
        if field is not None and (not isinstance(field, kind) or (kind is int and isinstance(field, bool))):
            path = f"{where}.{name}" if where else name
            raise _malformed(adapter_id, f"{path} is {_described(field)}, not {JSON_TYPES[kind]}")


JSON_TYPES = {list: "a list", dict: "an object", str: "a string", int: "an integer", bool: "true or false"}


def _described(value: object) -> str:
    """A JSON value as a message shows it: its text (short) and its type."""
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{json.dumps(value)[:40]} ({kind})"


def _malformed(adapter_id: str, what: str) -> AdapterUnavailable:
    return AdapterUnavailable(adapter_id, f"Civitai's answer is malformed: {what}",
                              "Try again later; if it persists, report it to Civitai (or the mirror's operator)")


def _primary_file(adapter_id: str, reference: CivitaiReference, version: dict) -> dict:
    """The version's SafeTensor weights file (the primary one when there are several), from an
    answer `_check_civitai_answer` passed."""
    if version.get("modelId") not in (None, reference.model):
        raise AdapterNotFound(adapter_id, f"version {reference.version} belongs to model {version.get('modelId')}, "
                              f"not {reference.model}", "Check the AIR: civitai:MODEL@VERSION")
    files = [f for f in version["files"] if f.get("type", "Model") == "Model"
             and (f.get("metadata") or {}).get("format") == "SafeTensor" and isinstance(f.get("downloadUrl"), str)]
    if not files:
        raise AdapterInvalid(adapter_id, "the version has no SafeTensor file (pickle files can run code)",
                             "Use a version published as .safetensors")
    return next((f for f in files if f.get("primary")), files[0])


def _host_pattern(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else (parts.hostname or "")


def may_download(sources, adapter_id: str) -> bool:
    """Whether finding the adapter in `sources` (an `AdapterSources`, or None) may wait on the
    network: a file elsewhere not in the download folder yet (or a URL's whose host is due to be
    resolved again), or a hub adapter (the Hub is asked for its files each time) that the
    adapter folder does not hold."""
    remote, hub, local = (getattr(sources, name, None) for name in ("remote", "hub", "local"))
    if remote is not None and remote.handles(adapter_id):
        return remote.may_wait(adapter_id)
    return hub is not None and hub.handles(adapter_id) and not (local is not None and local.has(adapter_id))


def download_deadline(sources, asked: float) -> float:
    """When the downloads of a request that asked at `asked` must end (`sources`: an
    `AdapterSources`, or None; without files elsewhere, never)."""
    remote = getattr(sources, "remote", None)
    return asked + remote.settings.total_timeout if remote is not None else math.inf
