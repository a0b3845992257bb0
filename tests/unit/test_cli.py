"""The `loraswap` command line: generate, adapters inspect, adapters make-random."""

import json

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from loraswap.cli import app
from loraswap.engine.config import EngineConfig, GenerateRequest
from loraswap.engine.engine import Engine

runner = CliRunner()


def test_generate_writes_the_engine_image(adapter_factory, tmp_path):
    adapter_factory("cli-style", "tiny-sd", rank=8, targets="all", alpha=16.0, seed=7)
    out = tmp_path / "out.png"
    result = runner.invoke(app, ["generate", "a cat", "--model", "tiny-sd", "--adapters", str(adapter_factory.root),
                                 "--lora", "cli-style:0.8", "--seed", "3", "--steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    engine = Engine(EngineConfig(model="tiny-sd", adapters=adapter_factory.root, compile=False, warmup=False))
    expected = engine.generate(GenerateRequest(prompt="a cat", seed=3, steps=2, loras=[("cli-style", 0.8)])).image
    base = engine.generate(GenerateRequest(prompt="a cat", seed=3, steps=2)).image
    written = np.asarray(Image.open(out))
    assert (written == np.asarray(expected)).all()
    assert (written != np.asarray(base)).any()


def test_generate_reads_flags_from_env(adapter_factory, tmp_path):
    out = tmp_path / "env.png"
    env = {"LORASWAP_MODEL": "tiny-sdxl", "LORASWAP_SEED": "4", "LORASWAP_STEPS": "2"}
    result = runner.invoke(app, ["generate", "a cat", "-o", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert "seed=4" in result.output
    assert Image.open(out).size == (64, 64)


def test_generate_unknown_adapter_is_a_clear_error(adapter_factory, tmp_path):
    result = runner.invoke(app, ["generate", "x", "--adapters", str(adapter_factory.root), "--lora", "missing",
                                 "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 1
    assert "adapter 'missing': no such adapter" in result.output


def test_inspect_reports_and_exits_by_fit(adapter_factory):
    path = adapter_factory("inspect-me", "tiny-sdxl", rank=16, targets="all", fmt="kohya", text_encoder=True,
                           alpha=8.0, base_model="tiny-sdxl")
    result = runner.invoke(app, ["adapters", "inspect", str(path), "--model", "tiny-sdxl", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["format"] == "kohya" and report["ranks"] == [16] and report["scales"] == [0.5]
    assert report["base_models"] == ["tiny-sdxl"] and report["fits"]
    assert set(report["targets"]) == {"unet", "text_encoder", "text_encoder_2"}
    result = runner.invoke(app, ["adapters", "inspect", "inspect-me", "--adapters", str(adapter_factory.root),
                                 "--model", "tiny-sd"])
    assert result.exit_code == 1
    assert "fits: False" in result.output


@pytest.mark.parametrize("model,fmt,first_key", [
    ("sd15", "kohya", "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"),
    ("sdxl", "diffusers", "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"),
    ("sdxl", "kohya", "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"),
    ("flux-dev", "kohya", "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"),
])
def test_make_random_real_layouts(model, fmt, first_key, tmp_path):
    out = tmp_path / "r.safetensors"
    result = runner.invoke(app, ["adapters", "make-random", "--model", model, "--rank", "4", "--format", fmt,
                                 "--text-encoder", "--base-model", model, "-o", str(out)])
    assert result.exit_code == 0, result.output
    with safe_open(str(out), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["base_model"] == model
        assert first_key in keys
        assert any("te" in k.split(".")[0] or k.startswith("text_encoder") for k in keys)
    result = runner.invoke(app, ["adapters", "inspect", str(out), "--model", model])
    assert result.exit_code == 0, result.output


def test_bench_swap_refuses_seed1_on_a_float8_base_before_building_anything(tmp_path):
    result = runner.invoke(app, ["bench", "swap", "--quantize", "fp8", "--workdir", str(tmp_path / "adapters")])
    assert result.exit_code == 2
    assert "seed 1 merges adapters through PEFT" in result.output
    assert not (tmp_path / "adapters").exists()  # nothing written: refused first
    result = runner.invoke(app, ["bench", "swap", "--quantize", "int4", "--variants", "loraswap",
                                 "--workdir", str(tmp_path / "adapters")])
    assert result.exit_code == 2 and "unknown quantization 'int4'" in result.output
    assert not (tmp_path / "adapters").exists()
