"""Random LoRA adapters with the key layouts real trainers write.

For tests and benchmarks: `make_random_adapter` targets the modules of a tiny preset
or of a real architecture (SD 1.5, SDXL, FLUX.1-dev, built on the meta device), and
writes them as diffusers/PEFT keys (`unet.<module>.lora_A.weight`) or as kohya keys
(`lora_unet_<module>.lora_down.weight` + `.alpha`; FLUX.1 in the original BFL naming
with fused qkv, as kohya's sd-scripts write it).
"""

import json
import math
import re
from typing import Literal

import torch
from torch import nn

Targets = Literal["attn", "all"]
Format = Literal["diffusers", "kohya"]
Kind = Literal["lora", "loha", "lokr", "dora"]
KINDS = ("lora", "loha", "lokr", "dora")

# component -> (attention-only pattern, all-layers pattern), matched with re.search on module names
_TARGETS = {
    "unet": (r"\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$", r"^(down_blocks|mid_block|up_blocks)\."),
    # every family's transformer: attention projections (image and text streams, fused ones),
    # or every layer of the numbered blocks but their norms (FLUX's `norm1.linear` is the modulation)
    "transformer": (r"\.(attn\d?|attention)\.(to_q|to_k|to_v|to_out(\.0)?|add_q_proj|add_k_proj|add_v_proj|"
                    r"to_add_out|to_qkv\w*)$",
                    r"^(transformer_blocks|single_transformer_blocks|blocks|layers)\.\d+\.(?!norm)"),
    "text_encoder": (r"\.self_attn\.(q_proj|k_proj|v_proj|out_proj|o_proj)$", r"\.(self_attn|mlp)\.\w+$"),
}
_TARGETS["transformer_2"] = _TARGETS["transformer"]  # Wan 2.2's low-noise expert
_TARGETS["text_encoder_2"] = _TARGETS["text_encoder_3"] = _TARGETS["text_encoder"]

_KOHYA_TE_PREFIX = {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_", "text_encoder_3": "lora_te3_"}

# kohya (BFL naming) -> the diffusers modules it fuses, for one FLUX.1 double / single block
_BFL_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
}
_BFL_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
}
_BFL_LINEAR1_INNER_DIM = 3072
_BFL_ATTN = ("img_attn_qkv", "img_attn_proj", "txt_attn_qkv", "txt_attn_proj")


def lora_target_shapes(component_name: str, module: nn.Module, targets: Targets) -> dict[str, tuple[int, ...]]:
    """module name -> weight shape, for the Linear/Conv2d layers `targets` selects."""
    pattern = _TARGETS[component_name][0 if targets == "attn" else 1]
    return {
        name: tuple(layer.weight.shape)
        for name, layer in module.named_modules()
        if isinstance(layer, (nn.Linear, nn.Conv2d)) and re.search(pattern, name)
        and not (isinstance(layer, nn.Conv2d) and layer.groups != 1)
    }


def _factors(shape: tuple[int, ...], rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (A, B) whose product changes W by roughly a fifth of its typical magnitude."""
    out_features, fan_in = shape[0], math.prod(shape[1:])
    down = torch.randn(rank, *shape[1:], generator=generator) / math.sqrt(fan_in)
    up = torch.randn(out_features, rank, *([1] * (len(shape) - 2)), generator=generator) * (0.1 / math.sqrt(rank))
    return down, up


def _layer_keys(kind: Kind, component_name: str, name: str, shape: tuple[int, ...], rank: int, alpha: float,
                fmt: Format, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's random tensors of `kind` under the format's key names."""
    if kind in ("loha", "lokr"):
        key = _kohya_name(component_name, name)
        tensors = (_loha if kind == "loha" else _lokr)(shape, rank, generator)
        return {f"{key}.{k}": v.to(dtype) for k, v in tensors.items()} | {f"{key}.alpha": torch.tensor(alpha,
                                                                                                    dtype=dtype)}
    down, up = _factors(shape, rank, generator)
    keys = _keys(component_name, name, down.to(dtype), up.to(dtype), alpha, fmt)
    if kind == "dora":  # LyCORIS's output-axis magnitudes, about the rows' norms
        magnitude = 1 + 0.1 * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=generator)
        keys[f"{_kohya_name(component_name, name)}.dora_scale"] = magnitude.to(dtype)
    return keys


def _loha(shape: tuple[int, ...], rank: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """LoHa factors (flattened conv kernels, as LyCORIS stores them without Tucker)."""
    out_features, fan_in = shape[0], math.prod(shape[1:])
    up, down = ((out_features, rank), 0.3 / math.sqrt(rank)), ((rank, fan_in), 1 / math.sqrt(fan_in))
    return {name: torch.randn(*size, generator=generator) * std
            for name, (size, std) in (("hada_w1_a", up), ("hada_w1_b", down), ("hada_w2_a", up), ("hada_w2_b", down))}


def _lokr(shape: tuple[int, ...], rank: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """LoKr factors: a full w1 [f, f] and w2 = w2_a @ w2_b, LyCORIS's layout for large layers."""
    out_features, in_features, kernel = shape[0], shape[1], math.prod(shape[2:])
    factor = next(f for f in (16, 8, 4, 2, 1) if out_features % f == 0 and in_features % f == 0)
    fan_in = in_features // factor * kernel
    return {"lokr_w1": torch.randn(factor, factor, generator=generator),
            "lokr_w2_a": torch.randn(out_features // factor, rank, generator=generator) * 0.1 / math.sqrt(rank),
            "lokr_w2_b": torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)}


def make_random_adapter(
    components: dict[str, nn.Module],
    rank: int,
    targets: Targets = "attn",
    fmt: Format = "diffusers",
    text_encoder: bool = False,
    alpha: float | None = None,
    base_model: str | None = None,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    kind: Kind = "lora",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A random adapter for `components` (name -> module): (state dict, safetensors metadata).

    `components` holds the denoiser (`unet` or `transformer`) and any text encoders;
    text encoders are targeted only with `text_encoder=True`. `alpha` defaults to the
    rank (scale 1); kohya files always carry it, diffusers files carry it in the
    `lora_adapter_metadata` that diffusers itself writes when it differs from the rank.
    `kind` other than `lora` writes LyCORIS's keys (`hada_`, `lokr_`, `dora_scale`: kohya
    format only); LoKr factors each weight by the largest of 16, 8, 4, 2 dividing both sides.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if kind != "lora" and fmt != "kohya":
        raise ValueError(f"{kind} adapters are written in LyCORIS's kohya-style keys: use the kohya format")
    alpha = float(rank if alpha is None else alpha)
    generator = torch.Generator().manual_seed(seed)
    state_dict: dict[str, torch.Tensor] = {}
    lora_metadata: dict[str, object] = {}
    for component_name, module in components.items():
        if component_name.startswith("text_encoder") and not text_encoder:
            continue
        shapes = _target_shapes(component_name, module, targets, fmt)
        for name, shape in shapes.items():
            state_dict.update(_layer_keys(kind, component_name, name, shape, rank, alpha, fmt, generator, dtype))
        if fmt == "diffusers" and alpha != rank and shapes:
            lora_metadata.update({f"{component_name}.r": rank, f"{component_name}.lora_alpha": alpha,
                                  f"{component_name}.target_modules": sorted(shapes)})
    metadata = {"format": "pt", "loraswap.generator": "make-random"}
    if lora_metadata:
        metadata["lora_adapter_metadata"] = json.dumps(lora_metadata)
    if base_model:
        metadata["base_model"] = base_model
    return state_dict, metadata


def _target_shapes(component_name: str, module: nn.Module, targets: Targets, fmt: Format) -> dict:
    """Module name (as the format names it) -> weight shape, for the targeted layers."""
    if fmt == "kohya" and type(module).__name__ == "FluxTransformer2DModel":
        return _bfl_shapes(module, targets)
    shapes = lora_target_shapes(component_name, module, targets)
    if fmt == "kohya" and component_name == "unet" and _is_sdxl(module):
        # sd-scripts' SDXL LoRAs: the transformer blocks, in SGM block numbering
        return {_sgm_name(name, module.config.layers_per_block): shape for name, shape in shapes.items()
                if ".attentions." in name}
    return shapes


def _keys(component_name: str, name: str, down: torch.Tensor, up: torch.Tensor, alpha: float,
          fmt: Format) -> dict[str, torch.Tensor]:
    """One layer's tensors under the format's key names."""
    if fmt == "diffusers":
        key = f"{component_name}.{_te_name(component_name, name)}"
        return {f"{key}.lora_A.weight": down, f"{key}.lora_B.weight": up}
    key = _kohya_name(component_name, name)
    return {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
            f"{key}.alpha": torch.tensor(alpha, dtype=down.dtype)}


def _is_sdxl(unet: nn.Module) -> bool:
    return getattr(unet, "config", {}).get("addition_embed_type") == "text_time"


def _sgm_name(module_name: str, layers_per_block: int) -> str:
    """diffusers UNet names -> SGM (original SDXL) names, as kohya's sd-scripts write them:
    down_blocks.b.attentions.j -> input_blocks.(b*(L+1)+j+1).1, mid_block.attentions.0 ->
    middle_block.1, up_blocks.b.attentions.j -> output_blocks.(b*(L+1)+j).1 (L: layers per
    down block; the up blocks have L+1)."""
    parts = module_name.split(".")
    if parts[0] == "mid_block":
        return ".".join(["middle_block", "1", *parts[3:]])
    block, index = int(parts[1]), int(parts[3])
    if parts[0] == "down_blocks":
        return ".".join(["input_blocks", str(block * (layers_per_block + 1) + index + 1), "1", *parts[4:]])
    return ".".join(["output_blocks", str(block * (layers_per_block + 1) + index), "1", *parts[4:]])


def _te_name(component_name: str, module_name: str) -> str:
    """Real files name CLIP layers from the text model (`text_model.encoder.layers...`),
    which transformers 5 flattens away in CLIPTextModel."""
    if component_name.startswith("text_encoder") and not module_name.startswith("text_model."):
        return "text_model." + module_name
    return module_name


def _kohya_name(component_name: str, module_name: str) -> str:
    if component_name.startswith("text_encoder"):
        return _KOHYA_TE_PREFIX[component_name] + _te_name(component_name, module_name).replace(".", "_")
    return "lora_unet_" + module_name.replace(".", "_")


def _bfl_shapes(module: nn.Module, targets: Targets) -> dict[str, tuple[int, ...]]:
    """FLUX.1 layers under their BFL names (what kohya writes), fused where BFL fuses them."""
    layers = dict(module.named_modules())
    result = {}
    for prefix, table, bfl_prefix in (("transformer_blocks", _BFL_DOUBLE, "double_blocks"),
                                      ("single_transformer_blocks", _BFL_SINGLE, "single_blocks")):
        count = len(getattr(module, prefix))
        for i in range(count):
            for bfl_name, parts in table.items():
                if targets == "attn" and bfl_name not in _BFL_ATTN:
                    continue
                if bfl_name == "linear1" and module.inner_dim != _BFL_LINEAR1_INNER_DIM:
                    continue  # diffusers' converter splits linear1 with FLUX.1's fixed sizes
                weights = [layers[f"{prefix}.{i}.{part}"].weight for part in parts]
                result[f"{bfl_prefix}.{i}.{bfl_name}"] = (sum(w.shape[0] for w in weights), weights[0].shape[1])
    return result
