"""The benchmarks run end to end (on tiny models here; the figures come from the GPU)."""

import json

from typer.testing import CliRunner

from loraswap.bench.serve import zipf_stream
from loraswap.cli import app


def test_zipf_stream_is_heavy_headed_and_fixed():
    stream = zipf_stream(2500, 5000, seed=1)
    assert stream == zipf_stream(2500, 5000, seed=1)
    head = sum(1 for k in stream if k == 0) / len(stream)
    assert 0.09 < head < 0.15  # 1 / H(2500) = 0.119
    assert len(set(stream)) > 500


def test_bench_serve_runs_both_modes(tmp_path):
    result = CliRunner().invoke(app, ["bench", "serve", "--model", "tiny-sd", "--adapters-count", "30",
                                      "--requests", "6", "--concurrency", "2", "--steps", "2", "--width", "64",
                                      "--height", "64", "--out", str(tmp_path / "out"), "--workdir",
                                      str(tmp_path / "work"), "--fused-args", "--attention _native_math"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "serve-tiny-sd.json").read_text())
    assert report["fused_args"] == ["--attention", "_native_math"]  # loraswap's server only: seed 1 stays seed 1
    assert "attention backend _native_math" in (tmp_path / "work" / "server-fused.log").read_text()
    assert "attention backend" not in (tmp_path / "work" / "server-diffusers.log").read_text()
    for mode in ("fused", "diffusers"):
        runs = report["modes"][mode]["runs"]
        assert [r["concurrency"] for r in runs] == [1, 2]
        assert all(r["errors"] == [] and len(r["latencies"]) == 6 for r in runs)
    assert set(report["speedup_p50"]) == {"1", "2"}
