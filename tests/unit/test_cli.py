"""The `loraswap` command line: generate, adapters inspect, adapters make-random."""

import hashlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import typer
import yaml
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from loraswap.cli import app
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.media.images import encode_image

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
    # a JPEG is written by the encoder the HTTP APIs answer with: the same bytes
    jpeg = tmp_path / "out.jpg"
    result = runner.invoke(app, ["generate", "a cat", "--model", "tiny-sd", "--adapters", str(adapter_factory.root),
                                 "--lora", "cli-style:0.8", "--seed", "3", "--steps", "2", "-o", str(jpeg)])
    assert result.exit_code == 0, result.output
    # (the same pixels, and the record of what ran as the server's images carry it)
    written_jpeg = Image.open(jpeg)
    assert np.array_equal(np.asarray(written_jpeg), np.asarray(Image.open(io.BytesIO(encode_image(expected, "JPEG")))))
    record = json.loads(written_jpeg.getexif()[0x010E])  # ImageDescription
    assert (record["prompt"], record["seed"], record["steps"]) == ("a cat", 3, 2)
    assert record["adapters"][0]["id"] == "cli-style" and record["adapters"][0]["sha256"] == \
        hashlib.sha256((adapter_factory.root / "cli-style.safetensors").read_bytes()).hexdigest()


def test_generate_writes_a_video_model_mp4(tmp_path):
    import imageio.v3 as iio

    out = tmp_path / "out.mp4"
    result = runner.invoke(app, ["generate", "a cat", "--model", "tiny-wan", "--frames", "5", "--seed", "1",
                                 "--steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    frames = iio.imread(out, index=None)
    assert frames.shape == (5, 64, 64, 3)
    still = runner.invoke(app, ["generate", "a cat", "--model", "tiny-wan", "--steps", "1", "-o",
                                str(tmp_path / "out.png")])
    # refused as a wrong use of the command line, before the model loads
    assert still.exit_code == 2 and "-o" in still.output and ".mp4" in still.output


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
    # over --max-rank: described all the same, and refused as the server refuses it
    result = runner.invoke(app, ["adapters", "inspect", str(path), "--model", "tiny-sdxl", "--max-rank", "8",
                                 "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["ranks"] == [16] and report["format"] == "kohya" and not report["fits"]
    assert "rank 16" in report["problem"] and "8" in report["problem"], report["problem"]


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


def test_bench_swap_refuses_an_unknown_quantization_before_building_anything(tmp_path):
    result = runner.invoke(app, ["bench", "swap", "--quantize", "int4", "--variants", "fused",
                                 "--workdir", str(tmp_path / "adapters")])
    assert result.exit_code == 2 and "unknown quantization 'int4'" in result.output
    assert not (tmp_path / "adapters").exists()


def _printed(args: list[str], env: dict | None = None) -> dict:
    result = runner.invoke(app, ["serve", *args, "--print-config"], env=env)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


def test_serve_settings_precedence_file_then_env_then_flags(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('port = 9000\nmax-queue = 64\nmax_batch = 2\nmodel = ["tiny-sd", "tiny-sdxl"]\nhub = true\n')
    printed = _printed(["--config", str(config)])
    assert (printed["port"], printed["max-queue"], printed["max-batch"]) == (9000, 64, 2)
    assert printed["model"] == ["tiny-sd", "tiny-sdxl"] and printed["max-wait-s"] == 30.0  # a default
    env = {"LORASWAP_MAX_QUEUE": "7", "LORASWAP_MAX_BATCH": "5"}
    printed = _printed(["--config", str(config), "--max-batch", "3", "--no-hub", "--model", "tiny-flux"], env)
    assert (printed["port"], printed["max-queue"], printed["max-batch"]) == (9000, 7, 3)
    assert printed["hub"] is False and printed["model"] == ["tiny-flux"]
    printed = _printed([], env={"LORASWAP_CONFIG": str(config)})
    assert printed["port"] == 9000


def test_serve_never_prints_keys(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: [sk-from-file]\n")
    result = runner.invoke(app, ["serve", "--config", str(config), "--admin-key", "adm-from-flag", "--print-config"],
                           env={"LORASWAP_API_KEY": "sk-env-1 sk-env-2"})
    assert result.exit_code == 0, result.output
    assert "sk-" not in result.output and "adm-" not in result.output
    assert "# api-key: 2 not printed" in result.output  # the variable's two keys, over the file's one
    assert "# admin-key: 1 not printed" in result.output
    config.write_text("api-key: [sk-from-file]\nmax-queue: 0\n")
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2 and "--max-queue" in result.output and "sk-" not in result.output


def test_serve_builds_the_config_it_serves(monkeypatch, tmp_path):
    import loraswap.cli.serve

    served = []
    monkeypatch.setattr(loraswap.cli.serve, "serve_on_socket", lambda config, listening: served.append(config))
    monkeypatch.setattr(loraswap.cli.serve, "bind_port", lambda host, port: None)
    monkeypatch.chdir(tmp_path)  # the file's adapter folder, relative
    (tmp_path / "demo-adapters").mkdir()
    examples = Path(__file__).parents[2] / "examples"
    result = runner.invoke(app, ["serve", "--config", str(examples / "serve.toml"), "--no-demo-adapters",
                                 "--swap-mode", "load-and-fuse", "--max-images", "2"],
                           env={"LORASWAP_API_KEY": "k1 k2", "LORASWAP_ADMIN_KEY": "a1"})
    assert result.exit_code == 0, result.output
    [config] = served
    assert [e.model for e in config.engines] == ["demo", "demo-flux"]
    assert all(e.swap.swap_mode == "load-and-fuse" and e.swap.max_rank == 256 for e in config.engines)
    assert (config.scheduler.max_queue, config.max_images) == (64, 2)
    assert (config.api_keys, config.admin_keys) == (["k1", "k2"], ["a1"])
    result = runner.invoke(app, ["serve", "--demo-adapters"])
    assert result.exit_code == 2 and "--demo-adapters needs --adapters DIR" in result.output


def _options(*path: str) -> dict:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return {param.name: param for param in command.params}


def test_shared_flags_are_defined_once():
    serve, generate, inspect = _options("serve"), _options("generate"), _options("adapters", "inspect")
    for name in ("compile", "compile_mode", "attention", "quantize", "device", "adapters"):
        assert serve[name].help == generate[name].help and serve[name].opts == generate[name].opts, name
    assert serve["max_rank"].help == inspect["max_rank"].help
    assert serve["model"].multiple and not generate["model"].multiple


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["deploy"], ["adapters", "inspect"],
                                     ["bench", "swap"], ["bench", "serve"], ["bench", "options"]])
def test_help_names_no_seed(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not re.search(r"seed[ _-]?[12]\b", result.output, re.IGNORECASE)


@pytest.mark.parametrize("spec,message", [("style:99", "out of range [-10, 10]"), ("style:nan", "out of range"),
                                          ("style:x", "must be a number"), ("a:0.5:0.3", "must be a number")])
def test_lora_flag_refuses_what_the_lora_header_refuses(spec, message, tmp_path):
    """One reader for `--lora`, the `lora` header and `model`: the same specs pass and fail."""
    from loraswap.adapters.naming.specs import parse_adapter_specs
    from loraswap.errors import BadRequest

    with pytest.raises(BadRequest) as header:
        parse_adapter_specs(spec)
    assert message in str(header.value)
    result = CliRunner().invoke(app, ["generate", "a fox", "--model", "tiny-sd", "--lora", spec,
                                      "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and not (tmp_path / "x.png").exists(), result.output
    assert str(header.value)[:40] in " ".join(result.output.split()), result.output


def test_lora_flag_takes_a_blend_as_the_header_does():
    from loraswap.adapters.reference import as_refs
    from loraswap.cli.generate import parse_loras

    assert parse_loras(["a:0.8, b", "c:-0.5"]) == as_refs([("a", 0.8), ("b", 1.0), ("c", -0.5)])
