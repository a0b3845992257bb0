"""`loraswap adapters inspect` names the family a file is for as a server routes it, without
being told a model; `adapters list`; and `bench` tables name a GPU only where there is one."""

import json

import pytest
from typer.testing import CliRunner

from loraswap.cli import app

runner = CliRunner()
DEMO = "src/loraswap/models/demo_weights/adapters"
DEMO_FLUX = "src/loraswap/models/demo_flux_weights/adapters"


def _inspect(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["adapters", "inspect", *args, "--json"])
    return result.exit_code, json.loads(result.output)


@pytest.mark.parametrize("path,model,family,found_by", [
    (f"{DEMO}/big.safetensors", "demo", "sd15", "its layers fit demo"),  # no metadata at all
    (f"{DEMO}/night.safetensors", "demo", "sd15", "its layers fit demo"),  # kohya's `ss_base_model_version: demo`
    (f"{DEMO_FLUX}/night.safetensors", "demo-flux", "flux", "its metadata names the family"),  # `flux1`
    (f"{DEMO_FLUX}/big.safetensors", "demo-flux", "flux", "its layers fit demo-flux"),
])
def test_inspect_without_a_model_names_the_model_the_server_routes_it_to(path, model, family, found_by):
    code, report = _inspect(path)
    assert code == 0, report
    assert (report["model"], report["family"], report["family_from"]) == (model, family, found_by)
    assert report["fits"] and report["problem"] is None and report["layers"] > 0


def test_inspect_with_another_model_says_it_does_not_fit_and_what_it_is_for():
    code, report = _inspect(f"{DEMO}/striped.safetensors", "--model", "tiny-sd")
    assert code == 1 and not report["fits"]
    assert report["model"] == "tiny-sd" and report["family"] == "sd15"
    assert report["family_from"] == "its layers fit demo"
    assert "does not exist in this model" in report["problem"]


def test_inspect_of_a_declared_base_model(adapter_factory):
    path = adapter_factory("declares", "tiny-sdxl", rank=4, targets="attn", base_model="tiny-sdxl")
    code, report = _inspect(str(path))
    assert code == 0
    assert report["base_models"] == ["tiny-sdxl"] and report["model"] == "tiny-sdxl"
    assert report["family_from"] == "it declares tiny-sdxl as its base model"


def test_adapters_list_names_the_ids_under_the_folder(tmp_path):
    result = runner.invoke(app, ["adapters", "list", "--adapters", DEMO])
    assert result.exit_code == 0
    assert result.output.split() == ["big", "night", "outline", "pastel", "striped"]
    result = runner.invoke(app, ["adapters", "list", "--adapters", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output


@pytest.mark.parametrize("env,label", [({}, "swap ms"), ({"gpu": "NVIDIA H100"}, "swap GPU ms")])
def test_bench_swap_names_the_gpu_only_on_a_gpu(env, label, tmp_path, capsys):
    from loraswap.bench.swap import report_swap_bench

    figures = {"p50": 0.002, "min": 0.001, "max": 0.003}
    results = {"summary": {"fused": {"image_s": figures, "swap_disk_s": figures, "swap_gpu_s": figures}},
               "quantize": "none", "shape": "tiny-sd", "width": 64, "height": 64, "steps": 2, "rounds": 1,
               "env": env, "recompile_check": {}, "memory_GiB": {}}
    report_swap_bench(results, tmp_path)
    header = results["table"].splitlines()[1]
    assert f"| {label} " in header and ("GPU" in header) == ("gpu" in env), header
