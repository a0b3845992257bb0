"""The download pool: a request's download deadline counts from the moment it entered the pool
(queued past it, a 503 before it starts), and requests waiting for a download another request
is making hold no thread of the pool, so that other downloads go on."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from support.web import Web, drip

from loraswap.adapters.reference import AdapterRef
from loraswap.adapters.sources.choose import AdapterSources
from loraswap.adapters.sources.download_waits import asked_at
from loraswap.adapters.sources.downloads import Download, DownloadCache
from loraswap.adapters.sources.remote import RemoteSettings, RemoteSources
from loraswap.errors import AdapterUnavailable, Overloaded
from loraswap.server.fetch_pool import FetchPool

MiB = 2**20
DATA = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


def _sources(total_timeout: float) -> SimpleNamespace:
    """Sources whose every `url:` adapter may wait on the network, downloads ending `total_timeout` s
    after the request asked."""
    remote = SimpleNamespace(settings=SimpleNamespace(total_timeout=total_timeout))
    return SimpleNamespace(remote=remote, may_wait=lambda ref: ref.source == "url")


def _writer(data: bytes, calls: list, gate: threading.Event | None = None, fail: bool = False):
    def fetch(dest, reserve):
        calls.append(dest)
        if gate is not None:
            assert gate.wait(30)
        if fail:
            raise AdapterUnavailable("url:a", "its host hung up", "Try again")
        reserve(len(data), 0)
        dest.write_bytes(data)
        return Download("url", "https://h.example/a.safetensors", "0" * 64)
    return fetch


def test_a_request_queued_past_its_deadline_is_refused_before_it_starts():
    """One thread, busy for 1 s; a request whose downloads must end 0.5 s after it asked is
    refused (503) when the thread frees, its work never started."""
    pool, started = FetchPool(threads=1), []

    async def main():
        busy = asyncio.create_task(pool.run(_sources(60), [AdapterRef("url:busy")], time.sleep, 1.0))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="waited for a download thread longer than --download-timeout-s"):
            await pool.run(_sources(0.5), [AdapterRef("url:late")], started.append, "late")
        await busy

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert started == []


def test_a_downloads_deadline_counts_from_when_its_request_entered_the_pool(tmp_path):
    """One thread, busy for 1.5 s, then a URL whose host drips a byte a second, with a 2.5 s
    download timeout: the 502 comes 2.5 s after the request asked, not 2.5 s after the thread
    took it up (4 s)."""
    web = Web({})
    data = bytes(64)
    web.routes["/drip.safetensors"] = drip(web, data, 10**6, 1.0)
    url = web.url("/drip.safetensors")
    remote = RemoteSources(RemoteSettings(url_allow=(f"127.0.0.1:{web.port}",), total_timeout=2.5), tmp_path, MiB)
    sources, ref, pool = AdapterSources(None, None, remote), AdapterRef.named(url), FetchPool(threads=1)

    async def main():
        busy = asyncio.create_task(pool.run(sources, [ref], time.sleep, 1.5))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(AdapterUnavailable, match="did not send the whole answer within 2.5 s"):
            await pool.run(sources, [ref], sources.locate, ref)
        await busy
        return time.monotonic() - started

    try:
        took = asyncio.run(main())
    finally:
        pool.close()
        web.close()
    assert took < 3.4, f"{took:.1f} s: the deadline counted from when a thread took it up"


def test_requests_waiting_for_one_download_hold_no_thread(tmp_path):
    """Two threads; eight requests name one adapter whose download hangs until released: one
    thread downloads it, the seven others wait without a thread, so a ninth request naming another
    adapter is served meanwhile. Released, all eight get the file, downloaded once."""
    cache, pool, gate, sources = DownloadCache(tmp_path, MiB), FetchPool(threads=2), threading.Event(), _sources(60)
    calls, other_calls = [], []

    async def main():
        waiting = [asyncio.create_task(pool.run(sources, [AdapterRef("url:a")], cache.fetch, "url:a",
                                                _writer(DATA, calls, gate))) for _ in range(8)]
        while not calls:
            await asyncio.sleep(0.01)
        other = await asyncio.wait_for(pool.run(sources, [AdapterRef("url:b")], cache.fetch, "url:b",
                                                _writer(DATA, other_calls)), 10)
        assert not any(task.done() for task in waiting), "the eight still wait"
        asked = await pool.run(sources, [AdapterRef("url:c")], asked_at)
        gate.set()
        return other, [await task for task in waiting], asked

    entered = time.monotonic()
    try:
        other, files, asked = asyncio.run(main())
    finally:
        gate.set()
        pool.close()
    assert other.read_bytes() == DATA and len(other_calls) == 1
    assert len(calls) == 1 and all(f.read_bytes() == DATA for f in files)
    assert entered < asked < time.monotonic(), "on the pool, a request's deadline counts from when it asked"


def test_requests_waiting_for_a_failed_download_each_get_an_error_of_their_own(tmp_path):
    """Eight requests, one download that fails: downloaded once, and each request gets the failure
    as an exception of its own (one object raised by eight would be changed by each raise)."""
    cache, pool, gate, calls = DownloadCache(tmp_path, MiB), FetchPool(threads=2), threading.Event(), []

    async def main():
        waiting = [asyncio.create_task(pool.run(_sources(60), [AdapterRef("url:a")], cache.fetch, "url:a",
                                                _writer(DATA, calls, gate, fail=True))) for _ in range(8)]
        while not calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the seven others handed their wait back (each in a moment)
        gate.set()
        return await asyncio.gather(*waiting, return_exceptions=True)

    try:
        errors = asyncio.run(main())
    finally:
        gate.set()
        pool.close()
    assert len(calls) == 1, "downloaded once, its failure shared"
    assert all(isinstance(e, AdapterUnavailable) and "its host hung up" in e.message for e in errors), errors
    assert len({id(e) for e in errors}) == 8, "each an exception of its own"
    assert list(tmp_path.iterdir()) == []
