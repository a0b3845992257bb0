"""docs/make-your-own-adapter.md: a LoRA for `demo` trained with diffusers and PEFT, saved in
diffusers' names (`save_lora_weights`) and in kohya's (diffusers' `convert_state_dict_to_kohya`,
which writes each alpha as an integer), serves the same image from either file."""

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from diffusers.utils import convert_all_state_dict_to_peft, convert_state_dict_to_kohya
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from support.docs import ROOT, run_page

from loraswap.adapters.reference import as_refs
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.engine.request import GenerateRequest
from loraswap.models import load_pipeline

PAGE = ROOT / "docs" / "make-your-own-adapter.md"
PROMPT = "a red circle at the left on white"
# the page shortened: 8 steps of training, not 200; its check over prompts at one place, not three
SHORT = {"STEPS = 200": "STEPS = 8", 'enumerate(("left", "center", "right"))': 'enumerate(("left",))'}


def images(folder, adapters: list[str | None]) -> list[np.ndarray]:
    """The demo's image of PROMPT (seed 4, 6 steps) with each adapter of `folder` (None: without one)."""
    engine = Engine(EngineConfig(model="demo", adapters=folder, compile=False, warmup=False))
    out = []
    for adapter in adapters:
        loras = [(adapter, 1.0)] if adapter else []
        with engine.lender.lease_now(as_refs(loras)) as lease:
            request = GenerateRequest(prompt=PROMPT, seed=4, steps=6, loras=loras)
            out.append(np.asarray(engine.generate_batch([request], lease)[0].image).astype(np.int16))
    return out


def assert_same_change(base: np.ndarray, diffusers: np.ndarray, kohya: np.ndarray) -> None:
    """Both files make the image within 1/255 of each other, and it is not the image without them."""
    assert np.abs(diffusers - kohya).max() <= 1
    assert np.abs(diffusers - base).mean() > 1.0  # of 255: the adapter changes the picture


@pytest.mark.slow
def test_a_peft_lora_saved_by_diffusers_and_by_its_kohya_converter_makes_the_same_image(tmp_path):
    pipeline = load_pipeline("demo")
    pipeline.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                         target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained weights stand-in: lora_B starts at zero
        for name, param in pipeline.unet.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(pipeline.unet),
                                              weight_name="mine.safetensors")
    kohya = convert_state_dict_to_kohya(convert_all_state_dict_to_peft(load_file(tmp_path / "mine.safetensors")))
    assert kohya and all(v.dtype == torch.int64 for k, v in kohya.items() if k.endswith(".alpha"))
    save_file(kohya, tmp_path / "mine-kohya.safetensors")
    assert_same_change(*images(tmp_path, [None, "mine", "mine-kohya"]))


@pytest.mark.slow
def test_the_pages_script_trains_saves_and_serves_as_written(tmp_path, monkeypatch):
    """The page, shortened (`SHORT`): trained, served by `loraswap serve`, called by curl and
    checked over prompts as the page does; then its two files compared."""
    assert all(old in PAGE.read_text() for old in SHORT), "the page no longer says what SHORT shortens"
    pictures = run_page(PAGE, tmp_path, monkeypatch, first_server=None, edits=SHORT)
    assert {"red.png", "green.png", "green-kohya.png"} <= set(pictures)
    folder = tmp_path / "my-adapters"
    assert sorted(p.name for p in folder.iterdir()) == ["green-kohya.safetensors", "green.safetensors"]
    assert_same_change(*images(folder, [None, "green", "green-kohya"]))
