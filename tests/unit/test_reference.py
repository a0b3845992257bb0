"""loraswap's fused swap against diffusers' own LoRA loading, on the same tiny models."""

import pytest
import torch
from support.numerics import assert_bitwise_equal, image_array, rel_err, weights_snapshot

from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.models import load_pipeline

PRESETS = ["tiny-sd", "tiny-sdxl", "tiny-flux"]
# alpha != rank everywhere, so the alpha/rank scaling is checked too; FLUX's tiny VAE damps
# changes, so its adapters are scaled up to keep the effect check meaningful
ALPHA_FACTOR = {"tiny-sd": 2.0, "tiny-sdxl": 2.0, "tiny-flux": 6.0}


def engine_for(preset, adapters_dir):
    return Engine(EngineConfig(model=preset, adapters=adapters_dir, compile=False, warmup=False))


def engine_image(engine, loras, seed=0):
    engine.set_adapters(loras)
    return image_array(engine.pipeline, seed=seed)


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
@pytest.mark.parametrize("preset", PRESETS)
def test_matches_diffusers_load_lora_weights(preset, fmt, adapter_factory):
    rank = 8
    path = adapter_factory(f"ref-{preset}-{fmt}", preset, rank=rank, targets="all", fmt=fmt, text_encoder=True,
                           alpha=rank * ALPHA_FACTOR[preset], seed=1)
    engine = engine_for(preset, path.parent)
    base = engine_image(engine, [])
    ours = engine_image(engine, [(path.stem, 1.0)])

    reference = load_pipeline(preset)
    reference.load_lora_weights(str(path), adapter_name="ref")
    theirs = image_array(reference)

    assert rel_err(theirs, base) >= 1e-2, "the adapter must visibly change the image"
    assert rel_err(ours, theirs) <= 1e-4
    # text encoder layers were fused too (the reference loads them as well)
    assert any(c.startswith("text_encoder") for c, _ in engine.adapters.read(AdapterRef(path.stem)).layers)


@pytest.mark.parametrize("preset", ["tiny-sd", "tiny-flux"])
def test_blend_matches_diffusers_set_adapters(preset, adapter_factory):
    factor = ALPHA_FACTOR[preset]
    a = adapter_factory(f"blend-a-{preset}", preset, rank=4, targets="attn", alpha=4 * factor, seed=2)
    b = adapter_factory(f"blend-b-{preset}", preset, rank=16, targets="all", text_encoder=True, alpha=16 * factor,
                        seed=3)
    engine = engine_for(preset, a.parent)
    ours = engine_image(engine, [(a.stem, 0.7), (b.stem, 0.4)])
    only_a = engine_image(engine, [(a.stem, 0.7)])

    reference = load_pipeline(preset)
    reference.load_lora_weights(str(a), adapter_name="a")
    reference.load_lora_weights(str(b), adapter_name="b")
    reference.set_adapters(["a", "b"], [0.7, 0.4])
    theirs = image_array(reference)

    assert rel_err(only_a, theirs) >= 1e-2, "the second adapter must matter"
    assert rel_err(ours, theirs) <= 1e-4


def test_mixed_alphas_per_layer_scale_each_layer(adapter_factory, tmp_path):
    """kohya files carry one alpha per layer; each layer is scaled by its own alpha/rank."""
    from safetensors.torch import load_file, save_file

    path = adapter_factory("alphas-src", "tiny-sd", rank=8, targets="attn", fmt="kohya", alpha=8.0, seed=4)
    state_dict = load_file(str(path))
    alpha_keys = sorted(k for k in state_dict if k.endswith(".alpha"))
    for i, key in enumerate(alpha_keys):
        state_dict[key] = torch.tensor(float(1 + i % 5), dtype=torch.float16)
    save_file(state_dict, str(tmp_path / "mixed.safetensors"))
    engine = engine_for("tiny-sd", tmp_path)
    bound = engine.adapters.read(AdapterRef("mixed"))
    scales = {layer.scale for layer in bound.layers.values()}
    assert scales == {(1 + i) / 8 for i in range(5)}

    # the fused weight equals W + alpha/rank * B @ A, layer by layer
    before = weights_snapshot(engine.components)
    engine.set_adapters([("mixed", 1.0)])
    after = weights_snapshot(engine.components)
    for (component, param), layer in bound.layers.items():
        key = f"{component}.{param}"
        expected = before[key] + layer.scale * (layer.up.float() @ layer.down.float())
        assert torch.allclose(after[key], expected, rtol=1e-5, atol=1e-6), key


def test_ten_swaps_then_base_is_bitwise_original(adapter_factory):
    root = adapter_factory.root / "ten"
    specs = [(4, "attn", "diffusers"), (128, "all", "kohya"), (8, "all", "diffusers"), (64, "attn", "kohya"),
             (16, "all", "diffusers"), (32, "attn", "diffusers"), (96, "all", "kohya"), (4, "all", "kohya"),
             (48, "attn", "diffusers"), (128, "attn", "kohya")]
    for i, (rank, targets, fmt) in enumerate(specs):
        adapter_factory(f"a{i}", "tiny-sdxl", rank=rank, targets=targets, fmt=fmt, text_encoder=i % 3 == 0,
                        seed=10 + i, folder=root)
    engine = engine_for("tiny-sdxl", root)
    original = weights_snapshot(engine.components)
    base_image = engine.generate(GenerateRequest(prompt="x", seed=5, steps=2)).image
    for i in range(len(specs)):
        engine.set_adapters([(f"a{i}", 1.0)])
        assert engine.applied_ids == ((f"a{i}", 1.0),)
    engine.set_adapters([])
    assert_bitwise_equal(original, engine.components)
    again = engine.generate(GenerateRequest(prompt="x", seed=5, steps=2)).image
    assert list(again.getdata()) == list(base_image.getdata())


def test_load_and_fuse_baseline_matches_the_fused_swap(adapter_factory, tmp_path):
    """`--swap-mode load-and-fuse` (the benchmark baseline) serves the same images."""
    adapter_factory("b1", "tiny-sd", rank=8, targets="all", text_encoder=True, alpha=16.0, seed=90, folder=tmp_path)
    adapter_factory("b2", "tiny-sd", rank=4, targets="attn", alpha=8.0, seed=91, folder=tmp_path)
    fused = engine_for("tiny-sd", tmp_path)
    baseline = Engine(EngineConfig(model="tiny-sd", adapters=tmp_path, swap_mode="load-and-fuse", warmup=False))
    for loras in ([("b1", 1.0)], [("b2", 1.0)], [("b1", 0.7), ("b2", 0.4)], []):
        ours, theirs = engine_image(fused, loras), engine_image(baseline, loras)
        assert rel_err(ours, theirs) <= 1e-4, loras
    assert baseline.applied_ids == ()
    assert not baseline.pipeline.get_list_adapters(), "the baseline unloaded its adapters"
