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

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import AdapterForbidden, AdapterInvalid, AdapterNotFound
from .downloads import Download, DownloadCache
from .fetch import FetchRules, display_url, fetch_file, fetch_json
from .references import CivitaiReference, S3Reference, check_id, is_remote, reference_of, source_of
from .source import AdapterLocation

CIVITAI_API = "https://civitai.com/api"
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

    @property
    def downloads(self) -> DownloadCache:
        """The download folder, made when first needed (a server that fetches nothing has none)."""
        if self._downloads is None:
            self._downloads = DownloadCache(self._download_dir, self._download_bytes)
        return self._downloads

    def list_ids(self) -> list[str]:
        """The adapters downloaded (they survive a restart)."""
        if self._downloads is None and not self._download_dir.is_dir():
            return []
        return [record["id"] for record in self.downloads.records()]

    def forget(self, adapter_id: str) -> None:
        """Drop the adapter's download (`DELETE /adapters/{id}`); it is fetched again when next named."""
        if self._downloads is not None or self._download_dir.is_dir():
            self.downloads.remove(adapter_id)

    def handles(self, adapter_id: str) -> bool:
        return is_remote(adapter_id)

    @staticmethod
    def source_of(adapter_id: str) -> str:
        """url, civitai or s3."""
        return source_of(adapter_id)

    def locate(self, adapter_id: str) -> AdapterLocation:
        """The adapter's file in the download cache, fetched first if it is not there."""
        check_id(adapter_id)
        source = source_of(adapter_id)
        self._check_enabled(adapter_id, source)
        found = self.downloads.path(adapter_id)
        if found is None:
            found = self.downloads.fetch(adapter_id, lambda dest: self._fetch(adapter_id, source, dest))
        record = self.downloads.record(adapter_id) or {}
        return AdapterLocation(adapter_id, found, None, source_says=record.get("base_model"))

    def _check_enabled(self, adapter_id: str, source: str) -> None:
        enabled = {"url": bool(self.settings.url_allow), "civitai": self.settings.civitai_api is not None,
                   "s3": self.settings.s3}
        if not enabled.get(source, False):
            raise AdapterForbidden(adapter_id, f"this server does not fetch adapters from {source} references",
                                   f"Start it with {ENABLED_BY[source]} (docs/adapters.md)")

    def _fetch(self, adapter_id: str, source: str, dest: Path) -> Download:
        reference = reference_of(adapter_id)
        if reference is None:  # a url: id whose URL this process never saw, and not on disk
            raise AdapterNotFound(adapter_id, "its download is no longer cached", "Name it by its URL again")
        if isinstance(reference, CivitaiReference):
            return self._fetch_civitai(adapter_id, reference, dest)
        if isinstance(reference, S3Reference):
            return self._fetch_s3(adapter_id, reference, dest)
        rules = self._rules(self.settings.url_allow)
        fetched = fetch_file(reference.url, dest, rules, adapter_id)
        return Download(source, display_url(reference.url), fetched.sha256)

    def _rules(self, allow: tuple[str, ...]) -> FetchRules:
        s = self.settings
        return FetchRules(allow=allow, max_bytes=s.max_bytes, connect_timeout=s.connect_timeout,
                          read_timeout=s.read_timeout, total_timeout=s.total_timeout)

    def _fetch_s3(self, adapter_id: str, reference: S3Reference, dest: Path) -> Download:
        # boto3 is imported here, not at start-up: it costs ~0.3 s to import and only `--s3` needs it
        from .s3 import S3Settings, fetch_s3
        s = self.settings
        settings = S3Settings(endpoint_url=s.s3_endpoint_url, max_bytes=s.max_bytes,
                              connect_timeout=s.connect_timeout, read_timeout=s.read_timeout,
                              total_timeout=s.total_timeout)
        _, sha256 = fetch_s3(reference.bucket, reference.key, dest, settings, adapter_id)
        return Download("s3", f"s3://{reference.bucket}/{reference.key}", sha256)

    # ---------------------------------------------------------------- Civitai
    def _fetch_civitai(self, adapter_id: str, reference: CivitaiReference, dest: Path) -> Download:
        api = self.settings.civitai_api.rstrip("/")
        # the API's own host is named, so a mirror on a private network works; its download
        # links may redirect to any public host (Civitai's storage)
        rules = self._rules(("*", _host_pattern(api)))
        headers = {"Authorization": f"Bearer {self.settings.civitai_token}"} if self.settings.civitai_token else {}
        version = fetch_json(f"{api}/v1/model-versions/{reference.version}", rules, adapter_id, headers)
        file = _primary_file(adapter_id, reference, version)
        fetched = fetch_file(file["downloadUrl"], dest, rules, adapter_id, headers)
        expected = (file.get("hashes") or {}).get("SHA256", "")
        if fetched.sha256.lower() != expected.lower():
            raise AdapterInvalid(adapter_id, f"the file downloaded does not match the SHA256 Civitai lists "
                                 f"({expected[:12] or 'none'}...)", "Try again later, or report it to Civitai")
        return Download("civitai", display_url(file["downloadUrl"]), fetched.sha256, version.get("baseModel"))


def _primary_file(adapter_id: str, reference: CivitaiReference, version: object) -> dict:
    """The version's SafeTensor weights file (the primary one when there are several)."""
    if not isinstance(version, dict) or not isinstance(version.get("files"), list):
        raise AdapterInvalid(adapter_id, "Civitai's answer names no files", "Check the version id")
    if version.get("modelId") not in (None, reference.model):
        raise AdapterNotFound(adapter_id, f"version {reference.version} belongs to model {version.get('modelId')}, "
                              f"not {reference.model}", "Check the AIR: civitai:MODEL@VERSION")
    files = [f for f in version["files"] if isinstance(f, dict) and f.get("type", "Model") == "Model"
             and (f.get("metadata") or {}).get("format") == "SafeTensor" and isinstance(f.get("downloadUrl"), str)]
    if not files:
        raise AdapterInvalid(adapter_id, "the version has no SafeTensor file (pickle files can run code)",
                             "Use a version published as .safetensors")
    return next((f for f in files if f.get("primary")), files[0])


def _host_pattern(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else (parts.hostname or "")
