"""Real key layouts of published adapters (tests/fixtures/key_layouts: names, shapes and
dtypes from public test fixtures and issue reports; no weights), rebuilt with random values
at real size and inspected against the real architectures on the meta device: every key
is claimed and none dropped, or the file is refused naming the key and why."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from loraswap.adapters.parse.changes import split_key
from loraswap.adapters.parse.module_layers import WEIGHT_KINDS, complete
from loraswap.cli import app

pytestmark = pytest.mark.slow  # every published key layout

CORPUS = Path(__file__).parent.parent / "fixtures" / "key_layouts"
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
UNKNOWN_RANK = 4  # sources that list names without ranks
# layouts that must be refused, and the words the refusal says (all of them, where several)
REFUSED = {
    "flux_bfl_control_lora": "FLUX control LoRA",
    # the source lists only the magnitude vectors, not the LoRA pairs they belong to
    "flux_simpletuner_peft_dora": "belongs to no weight change",
    # the source lists only the lora_up weights
    "sd15_kohya_lora_up_shapes": "has no lora_down weight",
    # bare BFL names: diffusers' FLUX.2 loader maps them to no module either
    "flux2_bare_bfl_lokr": ("'double_blocks.", "does not exist in this model"),
    # Stability's MMDiT names (fused qkv), which diffusers' SD3 loader does not convert
    "sd35_kohya_sai_names": ("'lora_unet_joint_blocks_0_", "does not exist in this model"),
    # a Wan I2V LoRA's image cross-attention: the T2V transformer has none
    "wan_i2v_lightx2v_comfy_on_t2v": ("k_img", "does not exist in this model"),
    # fused and split LoRAs of the same attention: diffusers keeps the split ones and skips
    # the fused; loraswap will not guess which one the trainer meant
    "z_image_kohya_fused_and_split": ("name the same weight",),
}


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


def whole_modules(layout: dict) -> dict:
    """The layout's tensors, without the modules a partial excerpt lists only some keys of
    (a LoRA's down without its up, say): what remains is what the published file has."""
    kinds: dict[str, dict[str, set]] = {}
    for key in layout["tensors"]:
        prefix, kind, factor = split_key(key)
        kinds.setdefault(prefix, {}).setdefault(kind, set()).add(factor)
    whole = {p for p, parts in kinds.items()
             if all(complete(kind, dict.fromkeys(factors)) for kind, factors in parts.items() if kind in WEIGHT_KINDS)
             and any(kind in WEIGHT_KINDS or kind == "bias" for kind in parts)}
    return {k: v for k, v in layout["tensors"].items() if split_key(k)[0] in whole}


def rebuild(layout: dict, path: Path) -> dict:
    """Random tensors with the layout's names, shapes and dtypes, saved to `path`."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    listed = (whole_modules(layout) if "PARTIAL" in layout["note"] else None) or layout["tensors"]
    for key, (shape, dtype) in listed.items():
        shape = [UNKNOWN_RANK if size is None else size for size in shape]
        value = torch.randn(shape, generator=generator) * 0.01
        if key.endswith((".alpha", "dora_scale", "lora_magnitude_vector")):
            value = value.abs() + 1.0
        tensors[key] = value.to(DTYPES[dtype])
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("file", corpus_files(), ids=lambda p: p.stem)
def test_every_key_of_a_real_layout_is_claimed(file, tmp_path):
    layout = json.loads(file.read_text())
    tensors = rebuild(layout, tmp_path / f"{file.stem}.safetensors")
    result = CliRunner().invoke(app, ["adapters", "inspect", str(tmp_path / f"{file.stem}.safetensors"),
                                      "--model", layout["model"], "--json", "--max-rank", "4096"])
    report = json.loads(result.output)
    if file.stem in REFUSED:
        words = REFUSED[file.stem] if isinstance(REFUSED[file.stem], tuple) else (REFUSED[file.stem],)
        assert result.exit_code == 1 and all(w in report["problem"] for w in words), report["problem"]
        assert "'" in report["problem"], "the refusal names the key"
        return
    assert result.exit_code == 0, report.get("problem")
    assert report["tensors"] == len(tensors)
    # every file module lands on its own model modules (two on one are refused): at least one each
    file_modules = {split_key(key)[0] for key in tensors}
    assert sum(report["modules"].values()) >= len(file_modules)
    assert set(report["kinds"]) <= {"transformer", "unet", "text_encoder", "text_encoder_2"}
