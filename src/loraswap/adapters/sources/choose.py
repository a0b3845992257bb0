"""Where an adapter comes from, chosen by one function (`AdapterSources.source_for`) from what
its ref says: a file elsewhere by its kind (`url:`, `civitai:`, `s3:`: the download folder,
`remote.py`), a folder or hub id from the adapter folder (`folder.py`) when the folder holds
it, else from the Hub (`hub.py`) when the id is shaped `owner/name[@revision]`.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.reference import AdapterRef, check_adapter_id, is_remote, source_of
from loraswap.adapters.sources.downloads import default_download_dir
from loraswap.adapters.sources.folder import FolderSource
from loraswap.adapters.sources.hub import HubSource
from loraswap.adapters.sources.remote import RemoteSettings, RemoteSources
from loraswap.errors import AdapterNotFound, LoraswapError

Source = FolderSource | HubSource | RemoteSources


class AdapterSources:
    """The adapter folder, the hub and files elsewhere (`remote`), each None when off."""

    def __init__(self, folder: FolderSource | None, hub: HubSource | None, remote: RemoteSources | None = None):
        self.folder, self.hub, self.remote = folder, hub, remote

    def source_for(self, ref: AdapterRef) -> Source:
        """The source of `ref`'s file (AdapterNotFound when none here takes it)."""
        if ref.source != "name":
            if self.remote is None:  # no files elsewhere here: its id is no id of this server's
                check_adapter_id(ref.adapter_id)
            return self.remote
        takes_hub = self.hub is not None and self.hub.handles(ref.adapter_id)
        if self.folder is not None and (not takes_hub or self.folder.has(ref.adapter_id)):
            return self.folder
        if takes_hub:
            return self.hub
        raise AdapterNotFound(ref.adapter_id, "no adapter folder is configured and it is not a hub id",
                              "Start the server with --adapters DIR or --hub")

    def locate(self, ref: AdapterRef) -> AdapterLocation:
        """The adapter's file, fetched first when it comes from elsewhere (the Hub, a URL, ...)."""
        return self.source_for(ref).locate(ref)

    def may_wait(self, ref: AdapterRef) -> bool:
        """Whether finding the adapter may wait on the network: a file elsewhere not in the
        download folder yet (or a URL's whose host is due to be resolved again), or a hub adapter
        (the Hub is asked for its files each time). A look, no more: the event loop asks."""
        try:
            source = self.source_for(ref)
        except LoraswapError:  # found nowhere: refused at once, without the network
            return False
        return source is self.hub or (source is self.remote and source.may_wait(ref))

    def list_ids(self) -> list[str]:
        folder = self.folder.list_ids() if self.folder is not None else []
        return folder + (self.remote.list_ids() if self.remote is not None else [])

    def source_name(self, adapter_id: str) -> str:
        """Where a listed adapter comes from: folder, hub, url, civitai or s3."""
        if is_remote(adapter_id):
            return source_of(adapter_id)
        in_folder = self.folder is not None and self.folder.has(adapter_id)
        return "hub" if self.hub is not None and self.hub.handles(adapter_id) and not in_folder else "folder"

    def evict(self, adapter_id: str) -> None:
        """Drop what is kept of the adapter beyond the caches: a download's file."""
        if self.remote is not None and is_remote(adapter_id):
            self.remote.evict(adapter_id)


@dataclass(frozen=True)
class SourceSettings:
    """Where a server's adapters may come from, as plain values: the adapter folder, the hub,
    files elsewhere (`remote`: each off until its setting turns it on) and their download folder."""

    folder: Path | None = None  # None: no adapter folder
    hub: bool = False
    hub_cache_dir: Path | None = None  # None: huggingface_hub's own (HF_HUB_CACHE)
    hub_allow: tuple[str, ...] = ("*",)
    hub_deny: tuple[str, ...] = ()
    max_bytes: int = 2 * 2**30  # the largest adapter file
    remote: RemoteSettings = RemoteSettings()
    download_dir: Path | None = None  # None: ~/.cache/loraswap/downloads
    download_bytes: int = 20 * 2**30  # the disk the downloads may take
    given: object | None = None  # a source object handed in by code (a test's), used as it is


def build_sources(settings: SourceSettings) -> AdapterSources:
    """The adapter folder, the hub, and files elsewhere, each as `settings` allow (files elsewhere
    are always there, to refuse each kind with the flag that turns it on); `settings.given`
    instead when there is one."""
    if settings.given is not None:
        return settings.given
    local = FolderSource(settings.folder) if settings.folder else None
    hub = (HubSource(settings.hub_cache_dir, settings.hub_allow, settings.hub_deny, settings.max_bytes)
           if settings.hub else None)
    remote = RemoteSources(settings.remote, settings.download_dir or default_download_dir(), settings.download_bytes)
    return AdapterSources(local, hub, remote)


def may_download(sources: AdapterSources | None, ref: AdapterRef) -> bool:
    """Whether finding the adapter in `sources` (an `AdapterSources`, a single source handed in
    by code, or None) may wait on the network."""
    may_wait = getattr(sources, "may_wait", None)
    return may_wait is not None and may_wait(ref)


def download_deadline(sources: AdapterSources | None, asked: float) -> float:
    """When the downloads of a request that asked at `asked` must end (without files elsewhere, never)."""
    remote = getattr(sources, "remote", None)
    return asked + remote.settings.total_timeout if remote is not None else math.inf
