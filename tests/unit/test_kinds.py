"""Every adapter kind against its trainer's own code, on the tiny presets.

The LyCORIS references are adapters created, randomized and saved by `lycoris-lora`
itself; the reference image is the pipeline with LyCORIS's own network applied (its
forward, as A1111 applies it: not `merge_to`, which scales LoHa and LoKr twice).
"""

import json

import pytest
import torch
from lycoris import LycorisNetwork, create_lycoris
from safetensors.torch import load_file, save_file
from support.numerics import assert_bitwise_equal, image_array, rel_err, weights_snapshot

from loraswap.adapters.kinds import FILE_KINDS, KINDS
from loraswap.adapters.parse.changes import SUFFIXES
from loraswap.adapters.reference import AdapterRef
from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine
from loraswap.errors import AdapterInvalid
from loraswap.models import load_pipeline

LYCORIS_CASES = {
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "lokr": dict(algo="lokr"),  # factor -1: full w1, factored w2 (full w2 on small layers)
    "lokr-factor-4": dict(algo="lokr", factor=4),
    "lokr-both-factored": dict(algo="lokr", factor=8, decompose_both=True),
    "lokr-tucker": dict(algo="lokr", factor=4, decompose_both=True, use_tucker=True),
    "locon-tucker": dict(algo="lora", use_tucker=True),
    "dora-lora": dict(algo="lora", dora_wd=True),
    "dora-loha-input-axis": dict(algo="loha", dora_wd=True, wd_on_output=False),
    "dora-lokr": dict(algo="lokr", factor=4, dora_wd=True),
    "full": dict(algo="full"),
}


def lycoris_adapter(pipeline, path, seed, multiplier=1.0, **kwargs):
    """LyCORIS networks on the UNet and the text encoder, kohya-named (`lora_unet_`,
    `lora_te_`), randomized and applied to `pipeline`; their weights saved to `path`."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for prefix, module in (("lora_unet", pipeline.unet), ("lora_te", pipeline.text_encoder)):
        LycorisNetwork.LORA_PREFIX = prefix
        network = create_lycoris(module, multiplier, 4, 2.0, **kwargs)
        with torch.no_grad():
            for lora in network.loras:
                for name, param in lora.named_parameters():
                    if not name.startswith("org"):
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        network.apply_to()
        part = path.with_name(path.stem + "-part.safetensors")
        network.save_weights(str(part), torch.float32, {})
        state_dict.update(load_file(str(part)))
        part.unlink()
    LycorisNetwork.LORA_PREFIX = "lycoris"
    save_file(state_dict, str(path))
    return state_dict


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kinds")
    return Engine(EngineConfig(model="tiny-sd", adapters=folder, compile=False, warmup=False)), folder


@pytest.mark.parametrize("case", list(LYCORIS_CASES))
def test_lycoris_kinds_match_lycoris_forward(case, tiny_sd):
    engine, folder = tiny_sd
    reference = load_pipeline("tiny-sd")
    state_dict = lycoris_adapter(reference, folder / f"{case}.safetensors", seed=len(case), **LYCORIS_CASES[case])
    theirs = image_array(reference)
    before = weights_snapshot(engine.components)
    engine.set_adapters([])
    base = image_array(engine.pipeline)
    engine.set_adapters([(case, 1.0)])
    ours = image_array(engine.pipeline)
    bound = engine.adapters.read(AdapterRef(case))

    assert rel_err(theirs, base) >= 2e-2, "the adapter must visibly change the image"
    assert rel_err(ours, theirs) <= 1e-4
    # every tensor of the file is applied: one change per LyCORIS module (and its bias)
    modules = {k.split(".")[0] for k in state_dict}
    assert len({(c, p.rsplit(".", 1)[0]) for c, p in bound.layers}) == len(modules)
    engine.set_adapters([])
    assert_bitwise_equal(before, engine.components)


@pytest.mark.parametrize("case", ["loha", "dora-lora"])
def test_a_weight_below_one_means_what_lycoris_means(case, tiny_sd):
    """0.5 scales a LoHa's change; for DoRA it interpolates the magnitude rescaling (LyCORIS's
    multiplier), which the docs explain."""
    engine, folder = tiny_sd
    reference = load_pipeline("tiny-sd")
    lycoris_adapter(reference, folder / f"half-{case}.safetensors", seed=7, multiplier=0.5, **LYCORIS_CASES[case])
    theirs = image_array(reference)
    engine.set_adapters([(f"half-{case}", 1.0)])
    full = image_array(engine.pipeline)
    engine.set_adapters([(f"half-{case}", 0.5)])
    ours = image_array(engine.pipeline)
    assert rel_err(full, theirs) >= 1e-2
    assert rel_err(ours, theirs) <= 1e-4


def test_a_blend_of_kinds_matches_lycoris_networks_stacked(tiny_sd):
    engine, folder = tiny_sd
    reference = load_pipeline("tiny-sd")
    lycoris_adapter(reference, folder / "stack-loha.safetensors", seed=11, multiplier=0.7, algo="loha")
    lycoris_adapter(reference, folder / "stack-lokr.safetensors", seed=12, multiplier=0.5, algo="lokr", factor=4)
    theirs = image_array(reference)
    engine.set_adapters([("stack-loha", 0.7)])
    only_loha = image_array(engine.pipeline)
    engine.set_adapters([("stack-loha", 0.7), ("stack-lokr", 0.5)])
    ours = image_array(engine.pipeline)
    assert rel_err(only_loha, theirs) >= 1e-2, "the second adapter must matter"
    assert rel_err(ours, theirs) <= 1e-4


def test_peft_dora_matches_peft_forward(tiny_sd):
    """PEFT's `lora_magnitude_vector`, saved as diffusers saves PEFT adapters, against
    PEFT's own DoRA forward (at weight 1 and through `set_adapters` at 0.6)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    engine, folder = tiny_sd
    reference = load_pipeline("tiny-sd")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"]
    reference.unet.add_adapter(LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in reference.unet.named_parameters():
            if "lora_" in name:
                scale = 0.3 if "magnitude" not in name else 0.05
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    peft_keys = get_peft_model_state_dict(reference.unet)
    assert any("lora_magnitude_vector" in k for k in peft_keys)
    metadata = {"lora_adapter_metadata": json.dumps({"unet.r": 4, "unet.lora_alpha": 8, "unet.use_dora": True})}
    save_file({f"unet.{k}": v.contiguous() for k, v in peft_keys.items()}, str(folder / "peft-dora.safetensors"),
              metadata)
    base = image_array(load_pipeline("tiny-sd"))
    for weight in (1.0, 0.6):
        reference.unet.set_adapters(["default"], [weight])
        theirs = image_array(reference)
        engine.set_adapters([("peft-dora", weight)])
        ours = image_array(engine.pipeline)
        assert rel_err(theirs, base) >= 2e-2
        assert rel_err(ours, theirs) <= 1e-4, weight


@pytest.mark.parametrize("key,kind", [
    ("lora_unet_down_blocks_0_attentions_0_proj_in.oft_blocks", "OFT"),
    ("lora_unet_down_blocks_0_attentions_0_proj_in.boft_R", "BOFT"),
    ("unet.down_blocks.0.attentions.0.proj_in.ia3_l.weight", "IA3"),
    ("lora_unet_down_blocks_0_attentions_0_proj_in.a1.weight", "GLoRA"),
    ("double_blocks.0.img_attn.norm.query_norm.scale", "FLUX control LoRA"),
])
def test_kinds_that_cannot_be_fused_are_refused_by_name(key, kind, tiny_sd):
    engine, folder = tiny_sd
    save_file({key: torch.ones(4, 4)}, str(folder / f"unfusable-{kind[:4]}.safetensors"))
    before = weights_snapshot(engine.components)
    with pytest.raises(AdapterInvalid, match=f"key '{key}' is from a {kind}"):
        engine.set_adapters([(f"unfusable-{kind[:4]}", 1.0)])
    assert_bitwise_equal(before, engine.components)


def test_the_adapter_list_shows_each_adapters_kinds(tiny_sd):
    engine, folder = tiny_sd
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.diff_b": torch.ones(16),  # a 1x1 conv, 16 channels
               "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_a": torch.ones(16, 2),
               "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w1_b": torch.ones(2, 16),
               "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w2_a": torch.ones(16, 2),
               "lora_unet_down_blocks_0_attentions_0_proj_in.hada_w2_b": torch.ones(2, 16)},
              str(folder / "listed.safetensors"))
    engine.adapters.read(AdapterRef("listed"))
    row = next(r for r in engine.adapters.rows() if r["id"] == "listed")
    assert row["kinds"] == ["bias", "loha"]


def test_a_lora_of_a_3x3_convolution_is_listed_as_locon(tiny_sd):
    """kohya and LyCORIS call a LoRA of the 3x3 convolutions a LoCon; a 1x1 one stays a LoRA."""
    engine, folder = tiny_sd
    conv_in = engine.pipeline.unet.conv_in.weight  # [out, 4, 3, 3]
    save_file({"lora_unet_conv_in.lora_down.weight": torch.ones(2, conv_in.shape[1], 3, 3),
               "lora_unet_conv_in.lora_up.weight": torch.ones(conv_in.shape[0], 2, 1, 1),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.ones(2, 16, 1, 1),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.ones(16, 2, 1, 1)},
              str(folder / "locon.safetensors"))
    engine.adapters.read(AdapterRef("locon"))
    row = next(r for r in engine.adapters.rows() if r["id"] == "locon")
    assert row["kinds"] == ["locon", "lora"]


def test_a_peft_folder_is_scaled_by_its_adapter_config(tiny_sd):
    """A raw PEFT folder (adapter_model.safetensors, `base_model.model.` keys) takes its
    lora_alpha from adapter_config.json, not alpha = rank."""
    engine, folder = tiny_sd
    (folder / "peft-folder").mkdir()
    module = "base_model.model.down_blocks.0.attentions.0.proj_in"  # a 1x1 conv, 16 channels
    save_file({f"{module}.lora_A.weight": torch.ones(2, 16, 1, 1), f"{module}.lora_B.weight": torch.ones(16, 2, 1, 1)},
              str(folder / "peft-folder" / "adapter_model.safetensors"))
    (folder / "peft-folder" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 8}))
    bound = engine.adapters.read(AdapterRef("peft-folder"))
    assert [layer.scale for layer in bound.layers.values()] == [4.0]


def test_the_parser_reads_exactly_the_registered_kinds_and_all_their_factors():
    """A kind in `kinds.KINDS` that no suffix of the parser names could never be read, and a
    suffix naming an unregistered kind could never be applied: the two lists move together."""
    not_weight_kinds = {"bias", "dora", "alpha", "modulation"}  # parts of a module that no kind owns
    assert {kind for _, kind, _ in SUFFIXES} - not_weight_kinds == set(FILE_KINDS)
    for name in FILE_KINDS:
        kind = KINDS[name]
        spelled = {factor for _, k, factor in SUFFIXES if k == name}
        needed = set().union(*kind.required, *kind.paired)
        assert needed <= spelled, f"{name}: no suffix for {sorted(needed - spelled)}"
        assert kind.name == name and kind.label
