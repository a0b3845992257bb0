"""The download cache under contention, threads and processes sharing one folder: nothing in
use is evicted, in-flight bytes count toward the budget, a start cleans only what no live
process holds, and those waiting for a fetch share its outcome within their deadline."""

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.web import Web, stream

from loraswap.adapters.sources import downloads
from loraswap.adapters.sources.download_locks import hold, holding_downloads, holding_downloads_in_coroutine
from loraswap.adapters.sources.downloads import LOCK_PREFIX, PARTIAL_PREFIX, Download, DownloadCache
from loraswap.adapters.sources.fetch import FetchRules, fetch_file
from loraswap.errors import AdapterInvalid, AdapterUnavailable, Overloaded

MiB = 2**20
HEAD = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"  # a safetensors header of no tensors: 10 bytes


def _writer(data: bytes, gate: threading.Event | None = None, calls: list | None = None, chunk: int = MiB):
    """A fetch that reserves the file's size first (as fetch.py does), then writes it in chunks."""
    def fetch(dest, reserve):
        if calls is not None:
            calls.append(dest)
        if gate is not None:
            assert gate.wait(30)
        with dest.open("wb") as out:
            reserve(len(data), 0)
            for start in range(0, len(data), chunk):
                out.write(data[start:start + chunk])
        return Download("url", "https://h.example/a.safetensors", "0" * 64)
    return fetch


@contextlib.contextmanager
def _folder_locked(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class Sampler:
    """The folder's bytes (reservations included) and allocated blocks, sampled every ms under the
    folder's lock (the moments between the cache's decisions): their peaks."""

    def __init__(self, folder):
        self.folder, self.peak_bytes, self.peak_disk = folder, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.001):
            files = {}
            with _folder_locked(self.folder):  # a snapshot: the cache decides only under this lock
                for entry in os.scandir(self.folder):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    files[stat.st_ino] = stat
            sizes, disk = sum(f.st_size for f in files.values()), sum(f.st_blocks * 512 for f in files.values())
            self.peak_bytes, self.peak_disk = max(self.peak_bytes, sizes), max(self.peak_disk, disk)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_sixteen_fetches_of_distinct_files_under_a_small_budget_never_fail(tmp_path):
    """16 threads, each a distinct 3 MiB file, --download-cache-gb 0.01 (3 fit), five rounds: every
    fetch gives its whole file, none is evicted while its user reads it, the folder stays in budget."""
    budget = int(0.01 * 2**30)
    cache = DownloadCache(tmp_path, budget)
    errors = []

    def use(round_: int, i: int) -> bytes:
        data = bytes([i]) * (3 * MiB)
        with holding_downloads():
            path = cache.fetch(f"url:{round_}-{i}", _writer(data), time.monotonic() + 60)
            time.sleep(0.02)  # in use a while, as a request reads it
            return path.read_bytes() == data

    with Sampler(tmp_path) as sampler, ThreadPoolExecutor(16) as pool:
        for round_ in range(5):
            futures = [pool.submit(use, round_, i) for i in range(16)]
            for future in futures:
                try:
                    assert future.result(timeout=60), "the bytes read are the file's"
                except Exception as e:  # noqa: BLE001 - every failure is counted, none may happen
                    errors.append(repr(e))
    assert errors == []
    assert sampler.peak_bytes <= budget and sampler.peak_disk <= budget, (sampler.peak_bytes, sampler.peak_disk)
    assert len(cache.records()) <= 3


def test_in_flight_bytes_count_toward_the_budget_over_real_fetches(tmp_path):
    """16 concurrent 7.5 MiB downloads (fetch.py, a real HTTP server) under a 10.7 MB budget: one
    at a time fits, and the folder never holds more than the budget, reservations included."""
    size, budget = int(7.5 * MiB), 10_700_000
    web = Web({})
    for i in range(16):
        web.routes[f"/{i}.safetensors"] = stream(web, f"/{i}.safetensors", HEAD, size, content_length=size)
    rules = FetchRules(allow=(f"127.0.0.1:{web.port}",), max_bytes=64 * MiB)
    cache = DownloadCache(tmp_path, budget)

    def download(i: int) -> int:
        with holding_downloads():
            path = cache.fetch(f"url:{i}", lambda dest, reserve: Download("url", "u", fetch_file(
                web.url(f"/{i}.safetensors"), dest, rules, f"url:{i}", reserve=reserve).sha256),
                time.monotonic() + 120)
            return path.stat().st_size

    try:
        with Sampler(tmp_path) as sampler, ThreadPoolExecutor(16) as pool:
            sizes = list(pool.map(download, range(16)))
    finally:
        web.close()
    assert sizes == [size] * 16
    assert sampler.peak_bytes <= budget, f"the folder peaked at {sampler.peak_bytes} B, over {budget} B"
    assert [r["bytes"] for r in cache.records()] == [size], "the last one stays; the others made room"


def test_a_file_in_use_is_never_evicted(tmp_path):
    """One request uses a file; another, holding none, waits for room until its deadline: the
    file in use is never dropped to make it."""
    cache = DownloadCache(tmp_path, 150)
    with holding_downloads(), ThreadPoolExecutor(1) as other_request:
        used = cache.fetch("url:used", _writer(b"u" * 100))
        started = time.monotonic()
        waiting = other_request.submit(cache.fetch, "url:other", _writer(b"o" * 100), time.monotonic() + 0.3)
        with pytest.raises(Overloaded, match="full of adapters in use"):  # no room while it is used
            waiting.result(timeout=30)
        assert 0.25 < time.monotonic() - started < 2
        assert used.read_bytes() == b"u" * 100 and [r["id"] for r in cache.records()] == ["url:used"]
        assert not any(p.name.startswith(PARTIAL_PREFIX) for p in tmp_path.iterdir()), "the refused one left nothing"
    other = cache.fetch("url:other", _writer(b"o" * 100), time.monotonic() + 5)  # released: it makes room now
    assert other.read_bytes() == b"o" * 100 and [r["id"] for r in cache.records()] == ["url:other"]


def test_a_request_whose_own_downloads_and_the_next_exceed_the_budget_gets_a_400_at_once(tmp_path):
    """A request already using a 100-byte download names another of 100 under a 150-byte budget:
    no wait could ever make room (its own files are in use), so a 400 saying so, at once, not a
    503 at its deadline that retrying cannot fix."""
    cache = DownloadCache(tmp_path, 150)
    with holding_downloads():
        first = cache.fetch("url:first", _writer(b"f" * 100))
        started = time.monotonic()
        with pytest.raises(AdapterInvalid, match=r"with the 100 bytes of the other downloads this request uses, "
                                                 r"more than the download folder may hold \(150 bytes\)") as error:
            cache.fetch("url:second", _writer(b"s" * 100), time.monotonic() + 3)
        assert time.monotonic() - started < 1, "at once, not at the deadline"
        assert error.value.status == 400 and "--download-cache-gb" in error.value.fix
        assert first.read_bytes() == b"f" * 100 and [r["id"] for r in cache.records()] == ["url:first"]
        assert not any(p.name.startswith(PARTIAL_PREFIX) for p in tmp_path.iterdir())


def test_two_requests_each_holding_a_download_never_wait_on_each_other(tmp_path):
    """Request A holds 100 bytes, request B 30, under a 150-byte budget; B names 30 more: it would
    fit alone, but there is no room while A's file is in use, and B waiting (holding its own) could
    wait on A waiting for B. B gets a 503 at once; once A is answered, B's retry fits."""
    cache, answered = DownloadCache(tmp_path, 150), threading.Event()

    def request_a(holding: threading.Event) -> None:
        with holding_downloads():
            cache.fetch("url:a", _writer(b"a" * 100))
            holding.set()
            assert answered.wait(30)

    holding = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(request_a, holding)
        try:
            assert holding.wait(30)
            with holding_downloads():
                cache.fetch("url:b", _writer(b"b" * 30))
                started = time.monotonic()
                with pytest.raises(Overloaded, match="full of adapters in use, some by this request"):
                    cache.fetch("url:c", _writer(b"c" * 30), time.monotonic() + 3)
                assert time.monotonic() - started < 1, "at once, not at the deadline"
        finally:
            answered.set()
        a.result(timeout=30)
    with holding_downloads():
        assert cache.fetch("url:b", _writer(b"x")).read_bytes() == b"b" * 30
        assert cache.fetch("url:c", _writer(b"c" * 30), time.monotonic() + 3).read_bytes() == b"c" * 30


def test_a_coroutine_releases_its_downloads_off_the_event_loop(tmp_path, monkeypatch):
    """Releasing a download may stat it, wait for the folder's lock and unlink it: a request's
    coroutine (the server's `generate`) has that done on a worker thread, never its event loop."""
    cache, released_in = DownloadCache(tmp_path, MiB), []

    def recorded_hold(fd, release):  # each file the cache holds for the request: where it is let go
        def recorded(fd):
            released_in.append(threading.current_thread())
            release(fd)
        hold(fd, recorded)
    monkeypatch.setattr(downloads, "hold", recorded_hold)

    async def request():
        async with holding_downloads_in_coroutine():
            await asyncio.to_thread(cache.fetch, "url:a", _writer(b"a" * 100))
            assert released_in == [], "in use until the request ends"
        return threading.current_thread()

    loop_thread = asyncio.run(request())
    assert len(released_in) == 1 and released_in[0] is not loop_thread
    assert cache.fetch("url:a", _writer(b"x")).read_bytes() == b"a" * 100, "released, still listed and found"


def test_a_file_over_the_whole_budget_is_refused_before_it_is_written(tmp_path):
    cache = DownloadCache(tmp_path, 100)
    with pytest.raises(AdapterInvalid, match=r"more than the download folder may hold \(100 bytes\)") as error:
        cache.fetch("url:big", _writer(b"b" * 101))
    assert "--download-cache-gb" in error.value.fix and list(tmp_path.iterdir()) == []


def test_those_waiting_for_a_fetch_share_its_failure(tmp_path):
    """Eight requests for one adapter whose host fails after 0.3 s: one fetch, eight errors at
    once, not eight fetches one after the other."""
    cache, calls = DownloadCache(tmp_path, MiB), []

    def failing(dest, reserve):
        calls.append(dest)
        time.sleep(0.3)
        raise AdapterUnavailable("url:a", "its host sent nothing for 0.3 s", "Try again")

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cache.fetch, "url:a", failing, time.monotonic() + 30) for _ in range(8)]
        errors = [f.exception(timeout=30) for f in futures]
    assert len(calls) == 1 and all(isinstance(e, AdapterUnavailable) for e in errors)
    assert len({id(e) for e in errors}) == 8, "each an exception of its own: one raised by eight threads is " \
        "changed by each raise"
    assert {e.message for e in errors} == {errors[0].message} and "sent nothing for 0.3 s" in errors[0].message
    assert time.monotonic() - started < 1.5
    assert list(tmp_path.iterdir()) == []


def test_a_wait_for_another_process_fetch_ends_at_the_deadline(tmp_path):
    """Two caches on one folder stand for two processes: the second waits for the first's fetch
    at most until its own deadline, then says so (502)."""
    first, second, gate = DownloadCache(tmp_path, MiB), DownloadCache(tmp_path, MiB), threading.Event()
    calls = []
    with ThreadPoolExecutor(1) as pool:
        fetching = pool.submit(first.fetch, "url:a", _writer(b"a" * 100, gate, calls))
        while not calls:
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(AdapterUnavailable, match="another process sharing the download folder is still fetching"):
            second.fetch("url:a", _writer(b"a" * 100), time.monotonic() + 0.3)
        assert time.monotonic() - started < 1.5
        gate.set()
        assert fetching.result(timeout=30).read_bytes() == b"a" * 100
    assert second.fetch("url:a", _writer(b"x")).read_bytes() == b"a" * 100, "then found, not fetched again"


def test_a_file_deleted_while_in_use_goes_with_its_last_user(tmp_path):
    """DELETE, or a file refused once read, while another request uses it: it is no longer
    listed nor found at once, and its bytes go when the last user lets go."""
    cache = DownloadCache(tmp_path, MiB)
    with holding_downloads():
        path = cache.fetch("url:a", _writer(b"a" * 100))
        assert cache.remove("url:a")
        assert cache.records() == [] and cache.path("url:a") is None
        assert path.read_bytes() == b"a" * 100, "still readable by its user"
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_a_start_cleans_only_what_no_live_process_holds(tmp_path):
    """Server B starting on server A's folder while A downloads: A's partial file and lock stay,
    and A's download completes; what a dead process left is removed."""
    (tmp_path / f"{PARTIAL_PREFIX}dead").write_bytes(b"left by a crash")
    (tmp_path / f"{LOCK_PREFIX}dead").write_bytes(b"")
    first, gate, calls = DownloadCache(tmp_path, MiB), threading.Event(), []
    with ThreadPoolExecutor(1) as pool:
        fetching = pool.submit(first.fetch, "url:a", _writer(b"a" * 100, gate, calls))
        while not calls:
            time.sleep(0.01)
        live = sorted(p.name for p in tmp_path.iterdir())
        assert any(n.startswith(PARTIAL_PREFIX) and n != f"{PARTIAL_PREFIX}dead" for n in live)
        DownloadCache(tmp_path, MiB)  # the other server starts
        after = sorted(p.name for p in tmp_path.iterdir())
        assert after == [n for n in live if not n.endswith("dead")], "only the dead process's files went"
        gate.set()
        assert fetching.result(timeout=30).read_bytes() == b"a" * 100


HOLDER = """
import fcntl, os, sys, time
for path in sys.argv[1:]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_lock_and_partial_files_of_a_process_killed_with_sigkill_are_cleaned(tmp_path):
    lock, partial = tmp_path / f"{LOCK_PREFIX}0123", tmp_path / f"{PARTIAL_PREFIX}0123"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(partial)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        DownloadCache(tmp_path, MiB)
        assert lock.exists() and partial.exists(), "a live process's files stay"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
    DownloadCache(tmp_path, MiB)
    assert list(tmp_path.iterdir()) == [], "after kill -9, no live process holds them: removed"
