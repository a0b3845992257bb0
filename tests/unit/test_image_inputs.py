"""Image inputs (img2img, inpainting) with adapters: loraswap's engine against diffusers' own
image pipelines with `load_lora_weights`, on the same tiny models."""

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.errors import BadRequest, UnsupportedInput
from loraswap.models import PRESET_FAMILIES, load_pipeline

PROMPT = "a red house by a lake"


def input_image() -> Image.Image:
    x, y = np.meshgrid(np.arange(64), np.arange(64))
    return Image.fromarray(np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8))


def half_mask() -> Image.Image:
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255  # white: repaint the right half
    return Image.fromarray(mask, "L")


def levels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.float64)


@pytest.mark.parametrize(("preset", "task"), [("tiny-sd", "img2img"), ("tiny-sdxl", "inpaint"),
                                              ("tiny-flux", "img2img"), ("tiny-flux", "inpaint"),
                                              ("tiny-sd3", "img2img"), ("tiny-qwen-image", "inpaint"),
                                              ("tiny-z-image", "img2img")])
def test_image_input_matches_diffusers_image_pipelines(preset, task, adapter_factory):
    # the tiny Qwen-Image damps an adapter's change more than the others: a larger scale
    alpha = 160.0 if preset.startswith("tiny-qwen") else 48.0
    path = adapter_factory(f"image-{preset}-{task}", preset, rank=8, targets="all", alpha=alpha, seed=21)
    engine = Engine(EngineConfig(model=preset, adapters=path.parent, compile=False, warmup=False))
    mask = half_mask() if task == "inpaint" else None
    request = GenerateRequest(prompt=PROMPT, seed=3, steps=4, image=input_image(), mask=mask, strength=0.7)
    base = levels(engine.generate(request).image)
    ours = levels(engine.generate(request.with_loras([(path.stem, 1.0)])).image)
    shared = engine.calls.pipeline(task)
    assert type(shared).__name__ == PRESET_FAMILIES[preset].image_pipelines[task]
    assert all(shared.components[name] is module for name, module in engine.components.items()), \
        "the image pipeline shares the loaded modules: no second copy"

    reference = load_pipeline(preset)
    reference.load_lora_weights(str(path), adapter_name="ref")
    image_pipeline = getattr(diffusers, PRESET_FAMILIES[preset].image_pipelines[task]).from_pipe(reference)
    extra = {"mask_image": mask} if mask is not None else {}
    theirs = levels(image_pipeline(PROMPT, image=input_image(), strength=0.7, num_inference_steps=4, width=64,
                                   height=64, generator=torch.Generator("cpu").manual_seed(3),
                                   **extra).images[0])
    assert np.abs(ours - base).mean() >= 1.0, "the adapter must visibly change the image"
    # 8-bit images: fused weights and PEFT's forward round differently, by a level at most
    assert np.abs(ours - theirs).max() <= 2 and np.abs(ours - theirs).mean() <= 0.05
    if mask is not None:  # inpainting keeps what the mask does not cover
        assert np.abs(ours[:, :24] - levels(input_image())[:, :24]).mean() < np.abs(ours[:, 40:] - levels(
            input_image())[:, 40:]).mean()


def test_refusals_change_nothing(adapter_factory):
    path = adapter_factory("image-refusal", "tiny-sd", rank=4, seed=22)
    engine = Engine(EngineConfig(model="tiny-sd", adapters=path.parent, compile=False, warmup=False))
    engine.set_adapters([(path.stem, 1.0)])
    for request, words in [
        (GenerateRequest(prompt="x", mask=half_mask()), "a mask needs the image"),
        (GenerateRequest(prompt="x", frames=5), "makes images, not videos"),
    ]:
        with pytest.raises(UnsupportedInput, match=words):
            engine.generate(request.with_loras([]))
        assert engine.applied_ids == ((path.stem, 1.0),), "a refused request leaves the applied adapters"


def test_img2img_makes_the_asked_size_where_the_pipeline_takes_none():
    """SD's img2img pipeline makes its input's size: the engine resizes the input to the ask."""
    engine = Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False))
    request = GenerateRequest(prompt=PROMPT, seed=1, steps=2, image=input_image().resize((72, 40)), width=64,
                              height=32, strength=0.5)
    assert engine.generate(request).image.size == (64, 32)


def test_a_model_without_image_inputs_refuses_an_image():
    engine = Engine(EngineConfig(model="tiny-wan", compile=False, warmup=False))
    with pytest.raises(UnsupportedInput, match="takes no image input"):
        engine.generate(GenerateRequest(prompt="x", image=input_image()))
    edit = Engine(EngineConfig(model="tiny-qwen-image-edit", compile=False, warmup=False))
    with pytest.raises(UnsupportedInput, match="edit model: send the image"):
        edit.generate(GenerateRequest(prompt="x"))


def test_every_family_image_pipeline_shares_the_loaded_modules():
    """Each family's img2img and inpainting pipelines exist in diffusers and are made from the
    loaded one with its very modules."""
    for preset, family in PRESET_FAMILIES.items():
        if not family.image_pipelines:
            continue
        engine = Engine(EngineConfig(model=preset, compile=False, warmup=False))
        for task, name in family.image_pipelines.items():
            made = engine.calls.pipeline(task)
            assert type(made).__name__ == name, (preset, task)
            assert all(made.components[c] is m for c, m in engine.components.items()), (preset, task)


@pytest.mark.parametrize(("preset", "request_fields", "words"), [
    ("tiny-sd3", {"width": 72}, "width that is a multiple of 16, not 72"),
    ("tiny-wan", {"output": "image"}, "makes videos, not images"),
    ("tiny-sd", {"output": "video"}, "makes images, not videos"),
    ("tiny-flux-kontext", {"image": input_image(), "strength": 0.5}, "takes no strength"),
])
def test_requests_the_model_cannot_take_are_refused_before_the_swap(preset, request_fields, words, adapter_factory):
    path = adapter_factory(f"refused-{preset}", preset, rank=4, seed=23)
    engine = Engine(EngineConfig(model=preset, adapters=path.parent, compile=False, warmup=False))
    with pytest.raises(UnsupportedInput, match=words):
        engine.generate(GenerateRequest(prompt="x", loras=[(path.stem, 1.0)], **request_fields))
    assert engine.applied_ids == (), "refused before the adapter was swapped in"


def test_a_strength_leaving_no_step_is_refused_only_where_the_pipeline_rounds_it_down():
    """SD's img2img denoises int(steps x strength) steps, none here, and its decode fails; FLUX.1's
    denoises at least one step for any strength, as diffusers runs it."""
    request = GenerateRequest(prompt=PROMPT, seed=1, steps=1, image=input_image(), strength=0.2)
    sd = Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False))
    with pytest.raises(BadRequest, match=r"strength 0.2 x 1 steps is 0.2, .* a strength of at least 1, or at least "
                                         r"5 steps"):
        sd.generate(request)
    flux = Engine(EngineConfig(model="tiny-flux", compile=False, warmup=False))
    assert flux.generate(request).image.size == input_image().size


def test_a_size_of_a_multiple_of_8_is_enough_for_sd():
    engine = Engine(EngineConfig(model="tiny-sd", compile=False, warmup=False))
    assert engine.generate(GenerateRequest(prompt="x", steps=1, width=72, height=40)).image.size == (72, 40)


def test_qwen_guidance_comes_with_a_blank_negative_prompt():
    from loraswap.models.families.qwen_image import guided_with_a_negative_prompt

    assert guided_with_a_negative_prompt({"prompt": ["a", "b"], "true_cfg_scale": 4.0})["negative_prompt"] == [" "] * 2
    kept = {"prompt": ["a"], "true_cfg_scale": 4.0, "negative_prompt": ["blur"]}
    assert guided_with_a_negative_prompt(kept) == kept
    assert "negative_prompt" not in guided_with_a_negative_prompt({"prompt": ["a"]})
