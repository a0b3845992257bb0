"""A download in a folder that servers share is served, and listed, only by a server whose own
source flags and address rules pass its reference, each time it is named: the rules of the
server that fetched it count for nothing. Nothing is fetched to find that out."""

import hashlib
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpcore
import pytest

from loraswap.adapters.reference import AdapterRef, source_of
from loraswap.adapters.sources import remote as remote_module
from loraswap.adapters.sources import url as url_module
from loraswap.adapters.sources.choose import AdapterSources, may_download
from loraswap.adapters.sources.downloads import Download
from loraswap.adapters.sources.fetch import display_url
from loraswap.adapters.sources.remote import RemoteSettings, RemoteSources
from loraswap.errors import AdapterForbidden

MiB = 2**20
DATA = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


@pytest.fixture
def connects(monkeypatch) -> list[str]:
    seen, original = [], httpcore.SyncBackend.connect_tcp

    def recorded(self, host, port, *args, **kwargs):
        seen.append(host)
        return original(self, host, port, *args, **kwargs)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", recorded)
    return seen


def _downloaded(sources: RemoteSources, adapter_id: str, shown: str, source: str = "url",
                origin: str | None = None) -> None:
    """The file as the server that fetched it left it in the shared folder."""
    def write(dest, reserve):
        dest.write_bytes(DATA)
        return Download(source, shown, hashlib.sha256(DATA).hexdigest(), origin=origin)
    sources.downloads.fetch(adapter_id, write)


def test_a_cached_url_passes_this_servers_own_rules_each_time_it_is_named(tmp_path, connects):
    url = "http://127.0.0.1:9/w.safetensors?X-Signature=SECRET"  # port 9: nothing listens, nothing is fetched
    ref = AdapterRef.named(url)
    url_id = ref.adapter_id
    a = RemoteSources(RemoteSettings(url_allow=("127.0.0.1:9",)), tmp_path, MiB)
    _downloaded(a, url_id, display_url(url))
    assert a.locate(ref).weights.read_bytes() == DATA and a.list_ids() == [url_id]

    b = RemoteSources(RemoteSettings(url_allow=("*",)), tmp_path, MiB)  # `*` never allows loopback
    for _ in range(2):  # each time, not only the first
        with pytest.raises(AdapterForbidden, match="plain http") as refused:
            b.locate(ref)
        assert refused.value.status == 403 and "SECRET" not in refused.value.message
    assert b.list_ids() == [], "a server lists only what it may serve"

    none = RemoteSources(RemoteSettings(), tmp_path, MiB)
    with pytest.raises(AdapterForbidden, match="Start it with --url-allow HOST"):
        none.locate(ref)
    assert none.list_ids() == []
    assert a.locate(ref).weights.read_bytes() == DATA, "the server whose rules pass still serves it"
    assert connects == [], "nothing was fetched to decide"


def test_a_cached_url_whose_name_resolves_to_loopback_is_refused_under_a_wildcard(tmp_path, connects):
    url = "https://localhost:9/w.safetensors"
    ref = AdapterRef.named(url)
    url_id = ref.adapter_id
    a = RemoteSources(RemoteSettings(url_allow=("localhost:9",)), tmp_path, MiB)
    _downloaded(a, url_id, display_url(url))
    assert a.locate(ref).weights.read_bytes() == DATA

    b = RemoteSources(RemoteSettings(url_allow=("*",)), tmp_path, MiB)
    with pytest.raises(AdapterForbidden, match="resolves to .*, a loopback address"):
        b.locate(ref)
    assert b.list_ids() == [] and a.list_ids() == [url_id] and connects == []


def test_a_download_through_another_api_or_store_is_not_served_here(tmp_path):
    """Civitai through another API (a mirror), a bucket through another store: listed and served
    only by servers using the same one; another fetches its own."""
    mirror = RemoteSources(RemoteSettings(civitai_api="http://127.0.0.1:9/api", s3=True,
                                          s3_endpoint_url="http://127.0.0.1:9"), tmp_path, MiB)
    _downloaded(mirror, "civitai:11@22", "http://127.0.0.1:9/api/download/22", "civitai", "http://127.0.0.1:9/api")
    _downloaded(mirror, "s3:team/k.safetensors", "s3://team/k.safetensors", "s3", "http://127.0.0.1:9")
    assert sorted(mirror.list_ids()) == ["civitai:11@22", "s3:team/k.safetensors"]
    other = RemoteSources(RemoteSettings(civitai_api="https://civitai.com/api", s3=True), tmp_path, MiB)
    assert other.list_ids() == []
    for adapter_id in ("civitai:11@22", "s3:team/k.safetensors"):
        assert other.downloads.path(adapter_id, other.same_origin(source_of(adapter_id))) is None


def test_whether_finding_an_adapter_may_wait_on_the_network(tmp_path, monkeypatch):
    """A URL adapter on disk still waits on the network when its host is due to be resolved
    again (its check is trusted a minute): routed then on the download pool, not on the pool that
    carries every request, where a slow resolver would stall them all."""
    ref = AdapterRef.named("https://h.example/x.safetensors")
    url_id = ref.adapter_id
    remote = RemoteSources(RemoteSettings(url_allow=("h.example",)), tmp_path, MiB)
    sources = AdapterSources(None, None, remote)
    assert may_download(sources, ref), "not downloaded yet"
    _downloaded(remote, url_id, "https://h.example/x.safetensors")
    assert may_download(sources, ref), "here, but its host not resolved yet by this server"
    remote.locate(ref)
    assert not may_download(sources, ref), "here, its URL checked within the minute: found without the network"
    later = time.monotonic() + url_module.VERDICT_S + 1
    monkeypatch.setattr(url_module, "time", SimpleNamespace(monotonic=lambda: later))
    assert may_download(sources, ref), "a minute on, its host is due to be resolved again"
    assert not may_download(sources, AdapterRef("style/anime")) and not may_download(None, ref)


def test_a_refused_url_is_refused_with_a_new_error_each_time(tmp_path):
    """--url-allow example.com, and a signed URL of another host named 50 times: each refusal is
    an exception of its own with a traceback as short as the first's. (One object raised again
    and again grows its traceback with each raise and keeps every raiser's frames alive.)"""
    ref = AdapterRef.named("http://10.0.0.1/a.safetensors?sig=SECRET")
    remote = RemoteSources(RemoteSettings(url_allow=("example.com",)), tmp_path, MiB)
    refusals = []
    for _ in range(50):
        with pytest.raises(AdapterForbidden, match="host 10.0.0.1 is not allowed") as refused:
            remote.locate(ref)
        refusals.append(refused.value)
    assert len({id(error) for error in refusals}) == 50, "a new exception each time"
    assert {len(traceback.extract_tb(error.__traceback__)) for error in refusals} == {
        len(traceback.extract_tb(refusals[0].__traceback__))}, "no traceback grows"
    assert all(error.status == 403 and "SECRET" not in error.message for error in refusals)


def test_requests_first_needing_the_download_folder_at_once_share_one_cache(tmp_path, monkeypatch):
    """Eight requests first need the download folder at once: one cache, whose fetches in flight
    they share (two caches would each lead a fetch of one adapter, the second holding a thread
    while it waits on the first's lock file)."""
    class SlowToOpen(remote_module.DownloadCache):
        def __init__(self, *args):
            time.sleep(0.05)  # its start cleans the folder: a moment in which others ask too
            super().__init__(*args)
    monkeypatch.setattr(remote_module, "DownloadCache", SlowToOpen)
    remote = RemoteSources(RemoteSettings(url_allow=("h.example",)), tmp_path, MiB)
    with ThreadPoolExecutor(8) as pool:
        caches = list(pool.map(lambda _: remote.downloads, range(8)))
    assert len({id(cache) for cache in caches}) == 1
