"""The download cache: one fetch per adapter however many wait, nothing partial ever served,
least recently used files dropped past the budget, and everything kept across a restart."""

import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraswap.adapters.sources.downloads import PARTIAL_PREFIX, Download, DownloadCache, default_download_dir
from loraswap.server.videos import state as video_state


def _writer(data: bytes, calls: list, gate: threading.Event | None = None):
    def fetch(dest, reserve):
        calls.append(dest)
        if gate is not None:
            assert gate.wait(30)
        dest.write_bytes(data)
        return Download("url", "https://h.example/a.safetensors", "0" * 64)
    return fetch


def test_one_fetch_however_many_ask_at_once(tmp_path):
    cache = DownloadCache(tmp_path, 2**20)
    calls, gate = [], threading.Event()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cache.fetch, "url:a", _writer(b"x" * 100, calls, gate)) for _ in range(8)]
        while not calls:  # the first fetch has started; the others wait for it
            time.sleep(0.01)
        gate.set()
        paths = {f.result(timeout=30) for f in futures}
    assert len(calls) == 1 and len(paths) == 1
    assert next(iter(paths)).read_bytes() == b"x" * 100
    assert cache.record("url:a")["shown"] == "https://h.example/a.safetensors"


def test_one_fetch_for_processes_sharing_the_folder(tmp_path):
    """The ranks of one image (or replicas on one machine) share the folder, each with its own
    cache: one of them fetches, the others read the same file, not a copy of their own."""
    caches = [DownloadCache(tmp_path, 2**20) for _ in range(4)]
    calls, gate = [], threading.Event()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(cache.fetch, "url:a", _writer(b"x" * 100, calls, gate)) for cache in caches]
        while not calls:
            time.sleep(0.01)
        time.sleep(0.2)  # the others are waiting, not fetching
        gate.set()
        inodes = {f.result(timeout=30).stat().st_ino for f in futures}
    assert len(calls) == 1 and len(inodes) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == \
        [caches[0].path("url:a").name], "no lock or partial file left"


def test_a_failed_fetch_leaves_nothing_and_a_crash_leaves_nothing_served(tmp_path):
    cache = DownloadCache(tmp_path, 2**20)

    def broken(dest, reserve):
        dest.write_bytes(b"half a file")
        raise RuntimeError("connection reset")

    with pytest.raises(RuntimeError):
        cache.fetch("url:b", broken)
    assert cache.path("url:b") is None and list(tmp_path.iterdir()) == []
    (tmp_path / f"{PARTIAL_PREFIX}left-by-a-crash").write_bytes(b"partial")
    restarted = DownloadCache(tmp_path, 2**20)
    assert list(tmp_path.iterdir()) == [] and restarted.records() == []


def test_least_recently_used_dropped_past_the_budget_and_kept_across_a_restart(tmp_path):
    cache = DownloadCache(tmp_path, 250)
    for name in ("url:old", "url:used", "url:new"):
        cache.fetch(name, _writer(b"y" * 100, []))
        past = time.time() - {"url:old": 300, "url:used": 200, "url:new": 100}[name]
        os.utime(cache.path(name).with_suffix(".json"), (past, past))  # last used then
    assert cache.path("url:old") is None, "the third file did not fit: the least recently used went"
    stamp = cache.path("url:used").stat()
    cache.path("url:used")  # used now: the most recent
    used = cache.path("url:used").stat()
    assert (used.st_mtime_ns, used.st_ctime_ns) == (stamp.st_mtime_ns, stamp.st_ctime_ns), \
        "a use leaves the file's own times, its stamp in the adapter cache, as they were"
    cache.fetch("url:newest", _writer(b"z" * 100, []))
    assert cache.path("url:new") is None and cache.path("url:used") is not None
    restarted = DownloadCache(tmp_path, 250)
    assert sorted(r["id"] for r in restarted.records()) == ["url:newest", "url:used"]
    assert restarted.path("url:newest").read_bytes() == b"z" * 100
    assert restarted.remove("url:used") and restarted.path("url:used") is None
    assert [r["id"] for r in restarted.records()] == ["url:newest"]


def test_the_suite_never_uses_the_users_loraswap_folders():
    """Hermetic: the default download and state folders, in this process and in the servers the
    tests start, are under the session's own cache folder (tests/conftest.py), never the
    user's, whose files would change what a server lists and serves."""
    session = Path(os.environ["XDG_CACHE_HOME"])
    assert session.is_relative_to(tempfile.gettempdir())
    assert default_download_dir() == session / "loraswap" / "downloads"
    assert video_state.default_state_dir().is_relative_to(tempfile.gettempdir())
    started = subprocess.run([sys.executable, "-c",
                              "from loraswap.adapters.sources.downloads import default_download_dir; "
                              "from loraswap.paths import user_cache; print(default_download_dir()); "
                              "print(user_cache('state'))"], capture_output=True, text=True, check=True)
    assert [Path(line) for line in started.stdout.split()] == [session / "loraswap" / "downloads",
                                                               session / "loraswap" / "state"]
