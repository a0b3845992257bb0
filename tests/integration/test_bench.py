"""The benchmarks run end to end (on tiny models here; the figures come from the GPU)."""

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from loraswap.bench.serve import start_server, zipf_stream
from loraswap.cli import app

pytestmark = pytest.mark.slow  # runs the benchmarks, servers and all


def test_zipf_stream_is_heavy_headed_and_fixed():
    stream = zipf_stream(2500, 5000, seed=1)
    assert stream == zipf_stream(2500, 5000, seed=1)
    head = sum(1 for k in stream if k == 0) / len(stream)
    assert 0.09 < head < 0.15  # 1 / H(2500) = 0.119
    assert len(set(stream)) > 500


def test_bench_serve_runs_both_modes(tmp_path):
    handler = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, ["bench", "serve", "--model", "tiny-sd", "--adapters-count", "30",
                                      "--requests", "6", "--concurrency", "2", "--steps", "2", "--width", "64",
                                      "--height", "64", "--out", str(tmp_path / "out"), "--workdir",
                                      str(tmp_path / "work"), "--fused-args", "--attention _native_math"])
    assert result.exit_code == 0, result.output
    assert signal.getsignal(signal.SIGTERM) is handler  # the bench leaves SIGTERM handling alone
    report = json.loads((tmp_path / "out" / "serve-tiny-sd.json").read_text())
    assert report["fused_args"] == ["--attention", "_native_math"]  # loraswap's server only, not the baseline's
    assert "attention backend _native_math" in (tmp_path / "work" / "server-fused.log").read_text()
    assert "attention backend" not in (tmp_path / "work" / "server-load-and-fuse.log").read_text()
    for mode in ("fused", "load-and-fuse"):
        runs = report["modes"][mode]["runs"]
        assert [r["concurrency"] for r in runs] == [1, 2]
        assert all(r["errors"] == [] and len(r["latencies"]) == 6 for r in runs)
        # the first pass meets each adapter first (cold, its read on the path); the second, none
        assert 1 <= sum(runs[0]["cold"]) <= report["distinct_in_stream"] and sum(runs[1]["cold"]) == 0
        data = report["modes"][mode]
        # cold against cached over the one-client pass only: with two clients a latency holds the queue
        cold = [t for t, is_cold in zip(runs[0]["latencies"], runs[0]["cold"]) if is_cold]
        cached = [t for t, is_cold in zip(runs[0]["latencies"], runs[0]["cold"]) if not is_cold]
        assert data["cold_requests"] == len(cold) and data["cold_p50_s"] == statistics.median(cold)
        assert data["cached_p50_s"] == (statistics.median(cached) if cached else None)
    assert set(report["speedup_p50"]) == {"1", "2"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="float8 activations load on this machine's GPU")
def test_a_server_whose_model_cannot_load_stops_the_bench_at_once(tmp_path):
    """Its /ready answers 503 for good, naming the error: the bench says so, not waits."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="fused server of tiny-flux could not load it: --quantize fp8 cannot run"):
        start_server("tiny-flux", tmp_path, "fused", tmp_path / "server.log", ["--quantize", "fp8"])
    assert time.monotonic() - started < 120


@pytest.mark.ray
def test_bench_serve_measures_ray_against_the_plain_server_in_turns(tmp_path):
    result = CliRunner().invoke(app, ["bench", "serve", "--model", "tiny-sd", "--adapters-count", "20",
                                      "--requests", "4", "--concurrency", "2", "--steps", "2", "--width", "64",
                                      "--height", "64", "--modes", "fused,ray", "--rounds", "2", "--out",
                                      str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "serve-tiny-sd.json").read_text())
    assert "deployment" in (tmp_path / "work" / "server-ray.log").read_text().lower()  # Ray Serve served it
    for mode in ("fused", "ray"):
        data = report["modes"][mode]
        assert [(r["round"], r["concurrency"]) for r in data["runs"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert all(r["errors"] == [] and len(r["compute_s"]) == 4 for r in data["runs"])
        # the server's compute is part of what the client waited for
        assert all(0 < c < lat for r in data["runs"] for c, lat in zip(r["compute_s"], r["latencies"]))
        assert data["recompiles"] == 0 and data["swap_ms_mean"] > 0 and data["cache_misses"] > 0
        # where each request's time went, from its Server-Timing; Ray's share only on Ray
        for run in data["runs"]:
            assert len(run["server_timing_ms"]) == 4
            assert {"parse", "read", "wait", "swap", "generate", "encode", "unaccounted"} <= set(run["phases_ms"])
            assert ("ray" in run["phases_ms"]) == (mode == "ray")
            assert run["phases_ms"]["generate"]["p50"] > 0
    assert set(report["ray_overhead"]) == {"1", "2"}
    one = report["ray_overhead"]["1"]
    medians = report["medians"]
    assert one["p50_ms"] == pytest.approx((medians["ray"]["1"]["p50_s"] - medians["fused"]["1"]["p50_s"]) * 1e3)
    assert "speedup_p50" not in report  # no baseline in this run


def _servers_under(folder: Path) -> list[int]:
    """PIDs of `loraswap serve` processes whose command line names `folder`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"serve" in cmdline and b"bench" not in cmdline and any(str(folder).encode() in part for part in cmdline):
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_bench_serve_stopped_stops_its_server(tmp_path, stop):
    """`timeout` stops a bench with SIGTERM (then SIGKILL): the server it started must not
    outlive it (on the GPU machine an orphaned server kept the GPU busy under the next run)."""
    bench = subprocess.Popen([sys.executable, "-m", "loraswap", "bench", "serve", "--model", "tiny-sd",
                              "--adapters-count", "10", "--requests", "2", "--steps", "2", "--width", "64",
                              "--height", "64", "--modes", "fused", "--out", str(tmp_path / "out"),
                              "--workdir", str(tmp_path / "work")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _servers_under(tmp_path / "work") and time.monotonic() < deadline:
            assert bench.poll() is None, "the bench ended before starting its server"
            time.sleep(0.1)
        servers = _servers_under(tmp_path / "work")
        assert servers, "no server started"
        bench.send_signal(stop)
        assert bench.wait(90) != 0
        deadline = time.monotonic() + 30
        while _servers_under(tmp_path / "work") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _servers_under(tmp_path / "work"), "the server outlived the bench"
    finally:
        bench.kill()
        for pid in _servers_under(tmp_path / "work"):
            os.kill(pid, signal.SIGKILL)


def test_bench_swap_runs_every_variant_on_a_tiny_preset_without_recompiling(tmp_path):
    """The four variants (the engine's own baseline swappers on a bare denoiser, the fused
    swap, the compiled base), interleaved: every round has each, the compiled copies never
    recompile across swaps, and the results are written."""
    # `--shape`: the earlier name of `--architecture` (bench kinds below), still accepted
    result = CliRunner().invoke(app, ["bench", "swap", "--shape", "tiny-sd", "--width", "64", "--height", "64",
                                      "--steps", "2", "--rounds", "2", "--recompile-swaps", "4",
                                      "--adapters-spec", "16:all,4:attn,8:all", "--out", str(tmp_path / "out"),
                                      "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "swap-tiny-sd.json").read_text())
    variants = ["load-and-fuse", "hotswap", "fused", "base"]
    assert sorted(r["variant"] for r in report["rows"]) == sorted(variants * 2)
    assert list(report["summary"]) == variants
    assert all(r["swap_disk_s"] > 0 for r in report["rows"] if r["variant"] != "base")
    assert report["recompile_check"] == {"swaps": 4, "graphs_compiled": 0, "graphs_compiled_during_rounds": 0}


def test_bench_kinds_swaps_every_kind_on_a_tiny_preset_without_recompiling(tmp_path):
    """Each kind read, bound and swapped into a compiled denoiser: written as `kinds.write`
    computes it, no recompile, each kind's swaps and images timed."""
    result = CliRunner().invoke(app, ["bench", "kinds", "--architecture", "tiny-flux", "--width", "64",
                                      "--height", "64", "--steps", "2", "--rank", "4", "--swaps", "2", "--rounds", "1",
                                      "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "kinds.json").read_text())
    assert list(report["adapters"]) == ["lora", "loha", "lokr", "dora"]
    assert [report["adapters"][k]["kinds"] for k in report["adapters"]] == [["lora"], ["loha"], ["lokr"],
                                                                            ["lora+dora"]]
    assert set(report["image_s"]) == {"base", "lora", "loha", "lokr", "dora"}
    assert all(report["swap_s"][f"{k}_{tier}"]["p50"] > 0 for k in report["adapters"] for tier in ("host", "gpu"))
    assert all(error <= 2 for error in report["max_error_in_rounding_steps"].values())
    assert report["recompiles"] == 0


def test_bench_family_swaps_per_request_against_base_and_load_and_fuse(tmp_path):
    from loraswap.bench.family import run_family_bench

    report = run_family_bench("tiny-sd", rank=4, rounds=2, out_dir=tmp_path, workdir=tmp_path / "adapters")
    assert set(report["summary"]) == {"base", "adapter", "load-and-fuse"}
    adapter_rows = [r for r in report["fused"]["rows"] if r["variant"] == "adapter"]
    assert len(adapter_rows) == 2 and all(r["swap_s"] > 0 for r in adapter_rows), "each adapter image swapped"
    assert len(report["fused"]["rows"]) == 4
    assert report["fused"]["recompiles"] == 0
    assert (tmp_path / "family-tiny-sd.json").exists()


def test_bench_swap_keeps_load_and_fuse_in_full_precision_beside_float8():
    """diffusers cannot merge into float8 weights: with --quantize the load-and-fuse copy stays
    in full precision (as a server using diffusers' loader would run), the others are float8."""
    import torch

    from loraswap.bench.swap import build_variants

    models, prefix, _ = build_variants("tiny-sd", ("load-and-fuse", "fused", "base"), "fp8-weight-only",
                                       torch.device("cpu"), torch.float32)
    assert prefix == "unet" and set(models) == {"load-and-fuse", "fused"}
    weight_types = {name: type(model.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight).__name__
                    for name, model in models.items()}
    assert weight_types == {"load-and-fuse": "Parameter", "fused": "Float8Tensor"}
