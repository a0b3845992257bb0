"""Compiling while loading: the staged load (modules built, then weights copied in) gives
the pipeline `from_pretrained` gives, bitwise; what it cannot load exactly it refuses before
copying anything; and the stand-in compiled beside the copy compiles every graph the
model's warm-up runs, while the model computes with its own weights."""

import json
import logging
import shutil

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file, save_file
from support.numerics import image_array, rel_err

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.startup.prewarm import Prewarm, denoiser_config
from loraswap.models import load_pipeline
from loraswap.models.staged import Unsupported, build_pipeline, fill_pipeline, plan_fill


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    for preset in ("tiny-sd", "tiny-sdxl", "tiny-flux"):
        load_pipeline(preset, device="cpu").save_pretrained(root / preset)
    # as FLUX.1-dev is published: the large modules in shards named by an index
    load_pipeline("tiny-flux", device="cpu").save_pretrained(root / "tiny-flux-sharded", max_shard_size="20KB")
    assert len(list((root / "tiny-flux-sharded" / "transformer").glob("*.safetensors"))) > 1
    return root


def _staged(folder, dtype):
    pipeline = build_pipeline(str(folder), torch.device("cpu"), dtype)
    fill_pipeline(plan_fill(pipeline, folder))
    return pipeline


@pytest.mark.parametrize("preset", ["tiny-sd", "tiny-sdxl", "tiny-flux", "tiny-flux-sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_staged_load_is_from_pretrained_bitwise(folders, preset, dtype):
    reference = load_pipeline(str(folders / preset), device="cpu", dtype=dtype)
    staged = _staged(folders / preset, dtype)
    assert type(staged) is type(reference) and dict(staged.config) == dict(reference.config)
    for name, module in reference.components.items():
        ours = staged.components[name]
        if not isinstance(module, torch.nn.Module):
            assert type(ours) is type(module), name
            continue
        config = (lambda m: dict(m.config)) if hasattr(module, "register_to_config") else (
            lambda m: m.config.to_dict())
        assert config(ours) == config(module), name
        for kind in ("named_parameters", "named_buffers"):  # buffers: the non-persistent ones too
            theirs, mine = dict(getattr(module, kind)()), dict(getattr(ours, kind)())
            assert theirs.keys() == mine.keys(), (name, kind)
            for key, value in theirs.items():
                assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), (name, key)
        assert len(list(ours.parameters())) == len(list(module.parameters())), f"{name}: tied weights tied"
        assert not ours.training and not any(p.requires_grad for p in ours.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: each piece converted from the file's fp32
def test_weights_copied_in_pieces_equal_weights_copied_whole(folders, monkeypatch, dtype):
    reference = _staged(folders / "tiny-flux", dtype)
    monkeypatch.setattr("loraswap.models.staged.COPY_BYTES", 100)  # pieces of 25 or 50 elements, the last one short
    pieces = _staged(folders / "tiny-flux", dtype)
    largest = max(p.nbytes for p in pieces.transformer.parameters())
    assert largest > 100 and largest % 100, "some weight is copied in several pieces, the last one short"
    for name, module in reference.components.items():
        if isinstance(module, torch.nn.Module):
            mine = pieces.components[name].state_dict()
            for key, value in module.state_dict().items():
                assert torch.equal(mine[key], value), (name, key)


def _copy(folders, tmp_path, preset="tiny-flux"):
    shutil.copytree(folders / preset, tmp_path / preset)
    return tmp_path / preset


def test_a_folder_it_cannot_load_exactly_is_refused_before_any_copy(folders, tmp_path):
    folder = _copy(folders, tmp_path)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    pipeline = build_pipeline(folder, torch.device("cpu"), torch.float32)
    assert plan_fill(pipeline, folder)  # as saved: planned
    # a key that is no weight of the model (from_pretrained would drop it), then missing ones:
    # refused by the plan, from the files' headers, so fill_pipeline never starts copying
    save_file({**tensors, "stray.weight": torch.zeros(2)}, weights)
    with pytest.raises(Unsupported, match="stray.weight"):
        plan_fill(pipeline, folder)
    save_file({k: v for k, v in tensors.items() if not k.startswith("proj_out")}, weights)
    with pytest.raises(Unsupported, match="lacks 2 weights"):
        plan_fill(pipeline, folder)
    # a variant beside the plain file is not read (from_pretrained without a variant does not)...
    save_file(tensors, weights)
    shutil.copy(weights, weights.with_name("diffusion_pytorch_model.fp16.safetensors"))
    assert plan_fill(pipeline, folder)
    # ...and a variant alone is refused
    weights.unlink()
    with pytest.raises(Unsupported, match="neither"):
        plan_fill(pipeline, folder)
    save_file(tensors, weights)
    (folder / "transformer" / "config.json").write_text(
        json.dumps({**json.loads((folder / "transformer" / "config.json").read_text()), "num_layers": 2}))
    with pytest.raises(Unsupported, match="lacks"):
        plan_fill(build_pipeline(folder, torch.device("cpu"), torch.float32), folder)
    # a class from a pipeline module (SD 1.5's safety checker) is not built here
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "vae": ["flux", "AutoencoderKL"]}))
    with pytest.raises(Unsupported, match="flux.AutoencoderKL"):
        build_pipeline(folder, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def eager_image(folders):
    return image_array(load_pipeline(str(folders / "tiny-flux"), device="cpu"))


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow  # compiles
def test_the_stand_in_compiles_every_graph_the_warm_up_runs_and_the_model_keeps_its_weights(
        folders, monkeypatch, eager_image):
    torch._dynamo.reset()
    seen = {"before": _graphs()}
    join = Prewarm.join

    def counting_join(self):
        seconds = join(self)
        seen["after_stand_in"] = _graphs()
        return seconds

    monkeypatch.setattr(Prewarm, "join", counting_join)
    engine = Engine(EngineConfig(model=str(folders / "tiny-flux"), compile=True, compile_while_loading=True))
    assert engine.startup_seconds["prewarm_s"] > 0
    assert seen["after_stand_in"] > seen["before"], "the stand-in's blocks were compiled"
    assert _graphs() == seen["after_stand_in"], "the warm-up image compiled nothing more"
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4, "the model's own weights"
    assert torch.get_default_dtype() is torch.float32, "the process's default dtype is as it was"


@pytest.mark.slow  # compiles
def test_a_stand_in_that_fails_leaves_the_compile_to_the_warm_up(folders, monkeypatch, caplog, eager_image):
    torch._dynamo.reset()
    before = _graphs()

    def broken(*args):
        raise RuntimeError("no room for the stand-in")

    monkeypatch.setattr("loraswap.engine.startup.prewarm.compile_denoiser", broken)  # the stand-in's compile
    with caplog.at_level(logging.WARNING, logger="loraswap.engine.startup.prewarm"):
        engine = Engine(EngineConfig(model=str(folders / "tiny-flux"), compile=True, compile_while_loading=True))
    assert "prewarm_s" not in engine.startup_seconds
    assert "compiling while loading failed (RuntimeError: no room for the stand-in)" in caplog.text
    assert _graphs() > before, "the warm-up compiled the blocks itself"
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4


@pytest.mark.slow  # compiles
def test_a_refused_folder_loads_through_from_pretrained_after_the_stand_in(folders, tmp_path, monkeypatch,
                                                                            eager_image):
    folder = _copy(folders, tmp_path)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    save_file({**load_file(weights), "stray.weight": torch.zeros(2)}, weights)
    order = []
    join, load = Prewarm.join, load_pipeline
    monkeypatch.setattr(Prewarm, "join", lambda self: order.append("stand-in done") or join(self))
    monkeypatch.setattr("loraswap.engine.startup.bring_up.load_pipeline",
                        lambda *a, **k: order.append("from_pretrained") or load(*a, **k))
    engine = Engine(EngineConfig(model=str(folder), compile=True, compile_while_loading=True))
    assert order == ["from_pretrained"], "refused by the plan: no stand-in started, from_pretrained alone"
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4


def test_nothing_is_compiled_while_loading_unless_asked_for_a_folder_with_regional_compile(folders, monkeypatch):
    started = []
    monkeypatch.setattr(Prewarm, "__init__", lambda self, *a, **k: started.append(a))
    folder = str(folders / "tiny-flux")
    assert Engine(EngineConfig(model=folder, compile=True, warmup=False)).startup_seconds.get("prewarm_s") is None
    Engine(EngineConfig(model=folder, compile=False, compile_while_loading=True, warmup=False))
    Engine(EngineConfig(model="tiny-flux", compile=True, compile_while_loading=True, warmup=False))
    Engine(EngineConfig(model=folder, compile=True, compile_while_loading=True, swap_mode="load-and-fuse",
                        warmup=False))
    assert not started
    cls, config = denoiser_config(folder)
    assert cls.__name__ == "FluxTransformer2DModel" and Prewarm.applies((cls, config))
    cls, _ = denoiser_config(str(folders / "tiny-sdxl"))
    assert cls.__name__ == "UNet2DConditionModel" and not Prewarm.applies((cls, {}))


@pytest.mark.slow  # compiles
def test_a_copy_that_fails_waits_for_the_stand_in_then_loads_through_from_pretrained(folders, monkeypatch,
                                                                                    caplog, eager_image):
    order = []
    join, load = Prewarm.join, load_pipeline

    def failing_copy(plan):
        order.append("copy failed")
        raise OSError("disk gone")

    monkeypatch.setattr(Prewarm, "join", lambda self: order.append("stand-in done") or join(self))
    monkeypatch.setattr("loraswap.engine.startup.bring_up.fill_pipeline", failing_copy)
    monkeypatch.setattr("loraswap.engine.startup.bring_up.load_pipeline",
                        lambda *a, **k: order.append("from_pretrained") or load(*a, **k))
    with caplog.at_level(logging.WARNING, logger="loraswap.engine.startup.bring_up"):
        engine = Engine(EngineConfig(model=str(folders / "tiny-flux"), compile=True, compile_while_loading=True))
    assert order == ["copy failed", "stand-in done", "from_pretrained"], "from_pretrained never beside a compile"
    assert "copying" in caplog.text and "OSError: disk gone" in caplog.text
    assert "prewarm_s" not in engine.startup_seconds
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4
