"""The hotswap baseline (`--swap-mode hotswap`) behind the engine's swapper interface:
the images of diffusers' own loading, and refusals that leave the model as it was."""

import pytest
import torch
from safetensors.torch import save_file
from support.numerics import assert_bitwise_equal, image_array, rel_err, weights_snapshot

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterIncompatible, BadRequest
from loraswap.models import load_pipeline

TARGET_RANK = 16


def engine_image(engine, loras):
    engine.set_adapters(loras)
    return image_array(engine.pipeline)


@pytest.fixture(scope="module")
def hotswap(adapter_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hotswap-adapters")
    adapter_factory("wide", "tiny-sd", rank=16, targets="all", alpha=32.0, seed=60, folder=folder)
    adapter_factory("narrow", "tiny-sd", rank=4, targets="attn", alpha=8.0, seed=61, folder=folder)
    adapter_factory("kohya", "tiny-sd", rank=8, targets="all", fmt="kohya", alpha=4.0, seed=62, folder=folder)
    adapter_factory("with-te", "tiny-sd", rank=4, targets="attn", text_encoder=True, seed=63, folder=folder)
    adapter_factory("too-wide", "tiny-sd", rank=32, targets="attn", seed=64, folder=folder)
    loha = {"lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_a": torch.ones(32, 2)}
    save_file(loha, str(folder / "loha.safetensors"))
    engine = Engine(EngineConfig(model="tiny-sd", adapters=folder, swap_mode="hotswap", hotswap_rank=TARGET_RANK,
                                 compile=False, warmup=False))
    engine.set_adapters([])  # the placeholder in place, as after a compiled start
    return engine, folder


@pytest.mark.parametrize("adapter", ["wide", "narrow", "kohya"])
def test_hotswap_serves_what_diffusers_load_lora_weights_draws(hotswap, adapter):
    engine, folder = hotswap
    reference = load_pipeline("tiny-sd")
    base = image_array(reference)
    reference.load_lora_weights(str(folder / f"{adapter}.safetensors"), adapter_name="ref")
    theirs = image_array(reference)
    ours = engine_image(engine, [(adapter, 1.0)])
    assert rel_err(theirs, base) >= 1e-2, "the adapter must visibly change the image"
    assert rel_err(ours, theirs) <= 1e-4
    assert engine.applied_ids == ((adapter, 1.0),)


def test_hotswap_back_to_the_base_model_draws_the_base_image(hotswap):
    engine, _ = hotswap
    engine_image(engine, [("wide", 1.0)])
    assert rel_err(engine_image(engine, []), image_array(load_pipeline("tiny-sd"))) <= 1e-6


@pytest.mark.parametrize("loras,error,match", [
    ([("with-te", 1.0)], AdapterIncompatible, "targets a text encoder"),
    ([("too-wide", 1.0)], AdapterIncompatible, "over the hotswap target rank 16"),
    ([("wide", 0.5)], BadRequest, "at weight 1 only"),
    ([("wide", 1.0), ("narrow", 1.0)], BadRequest, "one adapter at a time"),
    ([("loha", 1.0)], AdapterIncompatible, "hada_w1_a' is not a plain LoRA weight"),
])
def test_hotswap_refusals_change_nothing(hotswap, loras, error, match):
    engine, _ = hotswap
    engine.set_adapters([("narrow", 1.0)])
    before = weights_snapshot(engine.components)
    with pytest.raises(error, match=match):
        engine.set_adapters(loras)
    assert_bitwise_equal(before, engine.components)
    assert engine.applied_ids == (("narrow", 1.0),), "the engine still knows what is applied"
    assert rel_err(engine_image(engine, []), image_array(load_pipeline("tiny-sd"))) <= 1e-6
