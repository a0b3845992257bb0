"""A restarted server compiles from the persistent compile cache (--compile-cache).

One cold start fills an empty cache folder; a second process on the same folder (with
garbage entries added beside the good ones) finds every graph there: FX graph and
AOTAutograd cache hits and no misses, the same image, and its start-up in /metrics.
"""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.servers import ServerProcess

pytestmark = pytest.mark.slow  # compiles, then restarts

REQUEST = {"inputs": "a lighthouse", "parameters": {"seed": 3, "num_inference_steps": 2}}


def _startup(process: ServerProcess) -> tuple[dict, dict, float]:
    """Start-up seconds by phase, compile cache lookups {cache: {result: n}}, recompiles."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(process.url + "/metrics").text)}
    phases = {s.labels["phase"]: s.value for s in families["loraswap_startup_seconds"].samples
              if s.labels["model"] == "tiny-sd"}
    lookups: dict = {}
    for s in families["loraswap_compile_cache_lookups"].samples:
        lookups.setdefault(s.labels["cache"], {})[s.labels["result"]] = int(s.value)
    return phases, lookups, families["loraswap_recompiles"].samples[0].value


def _serve(cache_dir, log_path) -> tuple[dict, dict, float, bytes, str]:
    process = ServerProcess(["--model", "tiny-sd", "--compile", "--compile-cache", str(cache_dir)], log_path)
    try:
        process.wait_ready(timeout=300)
        image = httpx.post(process.url + "/", json=REQUEST, headers={"accept": "image/png"}, timeout=120)
        assert image.status_code == 200, image.text
        phases, lookups, recompiles = _startup(process)
    finally:
        process.stop()
    return phases, lookups, recompiles, image.content, process.log()


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A server started on an empty cache folder, stopped: (folder, what it reported)."""
    cache_dir = tmp_path_factory.mktemp("compile-cache") / "cache"
    return cache_dir, _serve(cache_dir, tmp_path_factory.mktemp("logs") / "cold.log")


def test_cold_start_compiles_fills_the_folder_and_reports_its_startup(cold):
    cache_dir, (phases, lookups, recompiles, _, log) = cold
    assert set(phases) == {"load", "warmup", "first_image"}
    # the first image is the warm-up's first: after the load, before the warm-up (its later images too) ends;
    # a second's slack for the model's set-up between the load and the warm-up
    assert phases["warmup"] > 0
    assert 0 < phases["load"] < phases["first_image"] <= phases["load"] + phases["warmup"] + 1.0
    assert lookups["fxgraph"]["miss"] >= 1 and lookups["fxgraph"]["hit"] == 0
    assert lookups["aotautograd"]["miss"] >= 1 and lookups["aotautograd"]["hit"] == 0
    assert recompiles == 0
    inductor = cache_dir / "inductor"
    assert len(list((inductor / "fxgraph").rglob("*"))) >= lookups["fxgraph"]["miss"]
    assert any(p.is_file() for p in (inductor / "aotautograd").rglob("*"))
    assert any(p.suffix == ".so" for p in inductor.rglob("*")), "the compiled kernels are in the folder"
    assert (cache_dir / "triton").is_dir()
    assert f"compile cache: {cache_dir}" in log


def test_restart_compiles_from_the_cache_past_garbage_entries(cold, tmp_path):
    cache_dir, (_, cold_lookups, _, cold_image, _) = cold
    # garbage beside every good entry, read first (names sort before torch's base32 hashes)
    entries = [p for sub in ("fxgraph", "aotautograd") for p in (cache_dir / "inductor" / sub).rglob("*")
               if p.is_file()]
    for entry in entries:
        (entry.parent / "00-garbage").write_bytes(b"\x80not a pickle" * 10)
    phases, lookups, recompiles, image, log = _serve(cache_dir, tmp_path / "warm.log")
    assert lookups["fxgraph"] == {"hit": cold_lookups["fxgraph"]["miss"], "miss": 0, "bypass": 0}
    assert lookups["aotautograd"] == {"hit": cold_lookups["aotautograd"]["miss"], "miss": 0, "bypass": 0}
    assert recompiles == 0
    assert image == cold_image, "the cached kernels make the same image"
    assert set(phases) == {"load", "warmup", "first_image"}
    assert "unable to load" in log, "torch read the garbage, warned and went on"
