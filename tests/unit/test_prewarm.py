"""Compiling while loading: a stand-in for the denoiser compiles the graphs the real model
runs, the real model's weights are what it computes with, and a stand-in that fails costs
nothing but a warning."""

import logging

import pytest
import torch
import torch._dynamo

from helpers import image_array, rel_err
from loraswap.engine import prewarm
from loraswap.engine.config import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.prewarm import Prewarm, denoiser_config
from loraswap.models import load_pipeline


@pytest.fixture(scope="module")
def eager_image():
    engine = Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False))
    return image_array(engine.pipeline)


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_stand_in_compiles_every_graph_the_warm_up_runs_and_the_model_keeps_its_weights(monkeypatch,
                                                                                           eager_image):
    torch._dynamo.reset()
    seen = {}
    join = Prewarm.join

    def counting_join(self, timeout=None):
        done = join(self, timeout)
        seen["graphs_after_prewarm"] = _graphs()
        return done

    monkeypatch.setattr(Prewarm, "join", counting_join)
    engine = Engine(EngineConfig(model="tiny-flux", compile=True))
    assert engine.prewarm is not None and engine.startup["prewarmed"] == 1.0
    assert seen["graphs_after_prewarm"] > 0, "the stand-in's blocks were compiled"
    assert _graphs() == seen["graphs_after_prewarm"], "the warm-up image compiled nothing more"
    # the compiled blocks compute with the real model's weights, not the stand-in's
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4


def test_a_stand_in_that_fails_leaves_the_compile_to_the_warm_up(monkeypatch, caplog, eager_image):
    torch._dynamo.reset()

    def broken(*args):
        raise RuntimeError("no room for the stand-in")

    monkeypatch.setattr(Prewarm, "_warm", staticmethod(broken))
    with caplog.at_level(logging.WARNING, logger="loraswap.engine.prewarm"):
        engine = Engine(EngineConfig(model="tiny-flux", compile=True))
    assert engine.startup["prewarmed"] == 0.0
    assert "compiling while loading failed (RuntimeError: no room for the stand-in)" in caplog.text
    assert _graphs() > 0, "the warm-up compiled the blocks itself"
    assert rel_err(image_array(engine.pipeline), eager_image) <= 1e-4


def test_no_stand_in_without_regional_compile_or_with_a_memory_cap(monkeypatch):
    started = []
    monkeypatch.setattr(prewarm.Prewarm, "__init__", lambda self, *a, **k: started.append(a))
    assert Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False)).prewarm is None
    assert Engine(EngineConfig(model="tiny-flux", compile=True, prewarm=False, warmup=False)).prewarm is None
    assert Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False)).prewarm is None
    assert Engine(EngineConfig(model="tiny-flux", compile=True, swap_mode="diffusers", warmup=False)).prewarm is None
    assert not started


def test_the_denoiser_config_is_read_from_a_folder_without_its_weights(tmp_path):
    load_pipeline("tiny-flux", device="cpu").save_pretrained(tmp_path / "flux")
    cls, config = denoiser_config(str(tmp_path / "flux"))
    assert cls.__name__ == "FluxTransformer2DModel" and config["num_layers"] == 1
    assert Prewarm.applies((cls, config))
    cls, config = denoiser_config("flux-dev-random")
    assert (cls.__name__, config["num_layers"], config["num_single_layers"]) == ("FluxTransformer2DModel", 19, 38)
    cls, _ = denoiser_config("sdxl-random")
    assert cls.__name__ == "UNet2DConditionModel" and not Prewarm.applies((cls, {}))
    assert denoiser_config(str(tmp_path / "missing")) is None
