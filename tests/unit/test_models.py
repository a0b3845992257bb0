"""Presets: real pipeline classes, same weights on every call, fast; local folders via from_pretrained."""

import time

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

from helpers import image_array, rel_err
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
    image_array(first)  # warm the lazy imports
    started = time.perf_counter()
    image = image_array(first)
    assert time.perf_counter() - started < 2.0
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


# the published parameter counts of the real models
@pytest.mark.parametrize("shape,params", [
    ("sd15", {"unet": 859_520_964, "text_encoder": 123_060_480}),
    ("sdxl", {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840}),
    ("flux-dev", {"transformer": 11_901_408_320, "text_encoder": 123_060_480}),
])
def test_real_shapes_on_meta_device(shape, params):
    _, components = lora_components(shape)
    assert {name: sum(p.numel() for p in m.parameters()) for name, m in components.items()} == params
    assert all(p.is_meta for m in components.values() for p in m.parameters())
