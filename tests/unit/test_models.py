"""Presets: real pipeline classes, same weights on every call, fast; local folders via from_pretrained."""

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from support.numerics import image_array, rel_err

from loraswap.models import load_pipeline, lora_components, model_name

CLASSES = {"tiny-sd": StableDiffusionPipeline, "tiny-sdxl": StableDiffusionXLPipeline, "tiny-flux": FluxPipeline}


@pytest.mark.parametrize("preset", list(CLASSES))
def test_preset_is_the_real_class_same_every_call_and_fast(preset):
    first, second = load_pipeline(preset), load_pipeline(preset)
    assert type(first) is CLASSES[preset]
    for name, component in first.components.items():
        if isinstance(component, torch.nn.Module):
            other = second.components[name].state_dict()
            assert all(torch.equal(v, other[k]) for k, v in component.state_dict().items()), name
    # fast: tiny enough that a test image takes milliseconds on a CPU (counted, not timed: a
    # busy machine must not fail it)
    parameters = sum(p.numel() for c in first.components.values() if isinstance(c, torch.nn.Module)
                     for p in c.parameters())
    assert parameters < 1_000_000, parameters
    image = image_array(first)
    assert image.shape == (64, 64, 3)
    assert (image == image_array(second)).all(), "same seed, same weights: same image"
    assert rel_err(image_array(first, seed=1), image) > 1e-3, "the seed matters"


def test_local_folder_goes_through_from_pretrained(tmp_path):
    preset = load_pipeline("tiny-sdxl")
    preset.save_pretrained(tmp_path / "my-model")
    loaded = load_pipeline(str(tmp_path / "my-model"))
    assert type(loaded) is StableDiffusionXLPipeline
    assert (image_array(loaded) == image_array(preset)).all()
    assert model_name(loaded, str(tmp_path / "my-model")) == loaded.config._name_or_path
    # served as the presets are, eval mode and no gradients: compiled blocks' guards check requires_grad
    modules = [c for c in loaded.components.values() if isinstance(c, torch.nn.Module)]
    assert modules and not any(m.training for c in modules for m in c.modules())
    assert not any(p.requires_grad for c in modules for p in c.parameters())


# the published parameter counts of the real models
@pytest.mark.parametrize("architecture,params", [
    ("sd15", {"unet": 859_520_964, "text_encoder": 123_060_480}),
    ("sdxl", {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840}),
    ("flux-dev", {"transformer": 11_901_408_320, "text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656}),
])
def test_real_architectures_on_meta_device(architecture, params):
    _, components = lora_components(architecture)
    assert {name: sum(p.numel() for p in m.parameters()) for name, m in components.items()} == params
    assert all(p.is_meta for m in components.values() for p in m.parameters())


def test_random_values_drawn_on_another_device_keep_ties_and_defaults():
    """`materialize_random` (a random model wanted in host RAM, drawn on the GPU): every
    parameter real on the target, tied parameters still one tensor, linear weights in
    PyTorch's default +-1/sqrt(fan_in) range with its spread, norm scales ones, biases zeros."""
    from transformers import T5Config, T5EncoderModel

    from loraswap.models.architectures import materialize_random

    with torch.device("meta"):
        model = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                        feed_forward_proj="gated-gelu", is_encoder_decoder=False))
    model = materialize_random(model, torch.device("cpu"), torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.shared.weight is model.encoder.embed_tokens.weight
    wi = model.encoder.block[0].layer[1].DenseReluDense.wi_0.weight  # (48, 32): fan_in 32
    assert wi.abs().max() <= 32 ** -0.5 and wi.std() == pytest.approx(32 ** -0.5 / 3 ** 0.5, rel=0.1)
    assert torch.equal(model.encoder.final_layer_norm.weight, torch.ones(32))
    out = model(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state
    assert torch.isfinite(out).all() and out.abs().max() > 0
    conv = materialize_random(torch.nn.Conv2d(4, 8, 3, device="meta"), torch.device("cpu"), torch.device("cpu"))
    assert conv.weight.abs().max() <= 36 ** -0.5 and torch.equal(conv.bias, torch.zeros(8))


@pytest.mark.parametrize("family, cls, computed", [
    ("wan", "WanTransformer3DModel", ("rope.freqs_cos", "rope.freqs_sin")),  # buffers
    ("qwen_image", "QwenImageTransformer2DModel", ("pos_embed.pos_freqs", "pos_embed.neg_freqs")),  # attributes
])
def test_a_component_drawn_on_another_device_keeps_the_tensors_its_constructor_computes(monkeypatch, family, cls,
                                                                                         computed):
    """`build_architecture_component(init_device=...)` starts only the parameters on meta:
    the rotary tables that Wan keeps as buffers and Qwen-Image as plain attributes come out
    as a normal build makes them."""
    import importlib
    from types import SimpleNamespace

    from loraswap.models import architectures

    module = importlib.import_module(f"loraswap.models.families.{family}")
    fake = SimpleNamespace(components={"transformer": (getattr(module, cls), module.TINY_TRANSFORMER)})
    monkeypatch.setattr(architectures, "architecture", lambda name: fake)
    normal = architectures.build_architecture_component("tiny", "transformer", "cpu")
    drawn = architectures.build_architecture_component("tiny", "transformer", "cpu", init_device="cpu:0")
    assert not any(p.is_meta for p in drawn.parameters())
    for name in computed:
        owner, _, leaf = name.rpartition(".")
        ours, reference = (getattr(m.get_submodule(owner), leaf) for m in (drawn, normal))
        assert not ours.is_meta and torch.equal(ours, reference)
