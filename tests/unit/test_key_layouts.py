"""Community key layouts: every tensor of a file lands where its trainer meant it.

FLUX.1 files name BFL modules (`double_blocks.0.img_attn.qkv`, a fused q/k/v), which
diffusers splits into three Linear layers: each kind's rows must follow. diffusers'
loader drops `.diff`, `.diff_b`, norm and T5 keys of these files; loraswap applies them.
"""

import torch
from lycoris.functional.loha import diff_weight as loha_diff_weight
from lycoris.functional.lokr import kron_weight
from safetensors.torch import save_file
from support.numerics import weights_snapshot

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.engine import Engine

HIDDEN, MLP, HEAD = 32, 128, 16  # tiny-flux: 2 heads of 16, MLP ratio 4
QKV = {"to_q": slice(0, 32), "to_k": slice(32, 64), "to_v": slice(64, 96)}


def tiny_flux(folder) -> Engine:
    return Engine(EngineConfig(model="tiny-flux", adapters=folder, compile=False, warmup=False))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape))) * 0.2


def test_flux_kohya_diff_bias_norm_and_t5_keys_are_all_applied(tmp_path):
    qkv, t5_q = "lora_unet_double_blocks_0_img_attn_qkv", "lora_te2_encoder_block_0_layer_0_SelfAttention_q"
    clip_norm = "text_encoders.clip_l.transformer.text_model.encoder.layers.0.layer_norm1.diff_b"  # ComfyUI naming
    tensors = {
        f"{qkv}.lora_down.weight": randn(4, HIDDEN), f"{qkv}.lora_up.weight": randn(3 * HIDDEN, 4),
        f"{qkv}.alpha": torch.tensor(8.0),
        f"{qkv}.diff_b": randn(3 * HIDDEN),
        "lora_unet_single_blocks_0_linear2.diff": randn(HIDDEN, HIDDEN + MLP),
        "lora_unet_double_blocks_0_img_attn_norm_query_norm.diff": randn(HEAD),
        f"{t5_q}.lora_down.weight": randn(4, HIDDEN), f"{t5_q}.lora_up.weight": randn(HIDDEN, 4),
        clip_norm: randn(HIDDEN),
    }
    save_file(tensors, str(tmp_path / "kohya-extras.safetensors"))
    engine = tiny_flux(tmp_path)
    before = weights_snapshot(engine.components)
    engine.set_adapters([("kohya-extras", 1.0)])
    after = weights_snapshot(engine.components)

    block = "transformer.transformer_blocks.0.attn"
    lora = 2.0 * tensors[f"{qkv}.lora_up.weight"] @ tensors[f"{qkv}.lora_down.weight"]  # alpha 8 / rank 4
    expected = {"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.weight":
                before["text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.weight"]
                + tensors[f"{t5_q}.lora_up.weight"] @ tensors[f"{t5_q}.lora_down.weight"],
                "transformer.single_transformer_blocks.0.proj_out.weight":
                before["transformer.single_transformer_blocks.0.proj_out.weight"]
                + tensors["lora_unet_single_blocks_0_linear2.diff"],
                f"{block}.norm_q.weight": before[f"{block}.norm_q.weight"]
                + tensors["lora_unet_double_blocks_0_img_attn_norm_query_norm.diff"],
                "text_encoder.encoder.layers.0.layer_norm1.bias":
                before["text_encoder.encoder.layers.0.layer_norm1.bias"] + tensors[clip_norm]}
    for name, rows in QKV.items():
        expected[f"{block}.{name}.weight"] = before[f"{block}.{name}.weight"] + lora[rows]
        expected[f"{block}.{name}.bias"] = before[f"{block}.{name}.bias"] + tensors[f"{qkv}.diff_b"][rows]
    for key, value in expected.items():
        torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6, msg=key)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(expected), "exactly the parameters the file names change"


def test_loha_and_lokr_on_fused_flux_layers_split_by_rows(tmp_path):
    """A LoHa on BFL's fused image qkv and a LoKr on the text qkv (whose q/k/v rows do not
    fall on Kronecker blocks) against LyCORIS's own functional rebuild of the whole fused
    change, split as diffusers splits the module."""
    qkv, txt_qkv = "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_attn_qkv"
    loha = {"hada_w1_a": randn(3 * HIDDEN, 4), "hada_w1_b": randn(4, HIDDEN, seed=1),
            "hada_w2_a": randn(3 * HIDDEN, 4, seed=2), "hada_w2_b": randn(4, HIDDEN, seed=3)}
    lokr = {"lokr_w1": randn(8, 4), "lokr_w2_a": randn(12, 2), "lokr_w2_b": randn(2, 8, seed=4)}  # 96 = 8 * 12
    tensors = {f"{qkv}.{k}": v for k, v in loha.items()} | {f"{txt_qkv}.{k}": v for k, v in lokr.items()}
    tensors |= {f"{qkv}.alpha": torch.tensor(2.0), f"{txt_qkv}.alpha": torch.tensor(1.0)}
    save_file(tensors, str(tmp_path / "fused.safetensors"))
    engine = tiny_flux(tmp_path)
    before = weights_snapshot(engine.components)
    engine.set_adapters([("fused", 1.0)])
    after = weights_snapshot(engine.components)

    loha_change = loha_diff_weight(loha["hada_w1_b"], loha["hada_w1_a"], loha["hada_w2_b"], loha["hada_w2_a"],
                                   None, None, gamma=0.5, backend="torch")
    lokr_change = kron_weight(lokr["lokr_w1"], None, None, None, lokr["lokr_w2_a"], lokr["lokr_w2_b"],
                              scale=0.5, backend="torch")
    block = "transformer.transformer_blocks.0.attn"
    expected = {f"{block}.{name}.weight": loha_change[rows] for name, rows in QKV.items()}
    expected |= {f"{block}.add_{name[3:]}_proj.weight": lokr_change[rows] for name, rows in QKV.items()}
    assert loha_change.abs().max() > 1e-2 and lokr_change.abs().max() > 1e-2
    for key, change in expected.items():
        torch.testing.assert_close(after[key] - before[key], change, rtol=1e-4, atol=1e-6, msg=key)
    assert {k for k in before if not torch.equal(before[k], after[k])} == set(expected)


def test_loha_and_lokr_in_trainer_naming_on_the_new_families(tmp_path):
    """LyCORIS kinds in the trainers' naming of newer families: a LoHa on Qwen-Image in kohya
    names and a LoKr on Wan 2.2 in ComfyUI names, against LyCORIS's functional rebuild."""
    cases = {
        "tiny-qwen-image": ("lora_unet_transformer_blocks_0_img_mlp_net_0_proj", "transformer",
                            "transformer_blocks.0.img_mlp.net.0.proj.weight"),
        "tiny-wan": ("diffusion_model.blocks.1.self_attn.q", "transformer", "blocks.1.attn1.to_q.weight"),
    }
    for preset, (prefix, component, param) in cases.items():
        engine = Engine(EngineConfig(model=preset, adapters=tmp_path, compile=False, warmup=False))
        out_features, in_features = engine.components[component].get_parameter(param).shape
        if preset == "tiny-qwen-image":
            factors = {"hada_w1_a": randn(out_features, 4), "hada_w1_b": randn(4, in_features, seed=1),
                       "hada_w2_a": randn(out_features, 4, seed=2), "hada_w2_b": randn(4, in_features, seed=3)}
            change = loha_diff_weight(factors["hada_w1_b"], factors["hada_w1_a"], factors["hada_w2_b"],
                                      factors["hada_w2_a"], None, None, gamma=0.5, backend="torch")  # 2 / 4
        else:
            factors = {"lokr_w1": randn(4, 2), "lokr_w2_a": randn(out_features // 4, 2),
                       "lokr_w2_b": randn(2, in_features // 2, seed=4)}
            change = kron_weight(factors["lokr_w1"], None, None, None, factors["lokr_w2_a"], factors["lokr_w2_b"],
                                 scale=1.0, backend="torch")  # alpha 2 / rank 2
        tensors = {f"{prefix}.{k}": v for k, v in factors.items()} | {f"{prefix}.alpha": torch.tensor(2.0)}
        save_file(tensors, str(tmp_path / f"{preset}.safetensors"))
        before = weights_snapshot(engine.components)
        engine.set_adapters([(preset, 1.0)])
        after = weights_snapshot(engine.components)
        key = f"{component}.{param}"
        assert change.abs().max() > 1e-2
        torch.testing.assert_close(after[key] - before[key], change, rtol=1e-4, atol=1e-6, msg=key)
        assert {k for k in before if not torch.equal(before[k], after[k])} == {key}


def test_wan_modulation_differences_are_applied_to_the_blocks_tables(tmp_path):
    """lightx2v's Wan LoRAs carry `diffusion_model.blocks.N.diff_m`, the change of a block's
    modulation table; diffusers' loader drops them with a log line, loraswap applies them."""
    engine = Engine(EngineConfig(model="tiny-wan", adapters=tmp_path, compile=False, warmup=False))
    table = engine.pipeline.transformer.blocks[0].scale_shift_table
    q = engine.pipeline.transformer.blocks[0].attn1.to_q.weight
    tensors = {"diffusion_model.blocks.0.diff_m": randn(*table.shape), "diffusion_model.blocks.0.self_attn.q.lora_down"
               ".weight": randn(2, q.shape[1], seed=1), "diffusion_model.blocks.0.self_attn.q.lora_up.weight":
               randn(q.shape[0], 2, seed=2), "diffusion_model.blocks.0.self_attn.q.alpha": torch.tensor(2.0)}
    save_file(tensors, str(tmp_path / "lightx2v.safetensors"))
    before = weights_snapshot(engine.components)
    engine.set_adapters([("lightx2v", 1.0)])
    after = weights_snapshot(engine.components)
    key = "transformer.blocks.0.scale_shift_table"
    torch.testing.assert_close(after[key] - before[key], tensors["diffusion_model.blocks.0.diff_m"])
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {key, "transformer.blocks.0.attn1.to_q.weight"}
    engine.set_adapters([])
    assert all(torch.equal(before[k], v) for k, v in weights_snapshot(engine.components).items())
