"""Train `demo-flux`'s adapters, each written in the layout its trainers' libraries write.

- `outline`: a LoRA through PEFT on every linear layer of the blocks, written by diffusers'
  `FluxPipeline.save_lora_weights` (diffusers names, `transformer.<module>.lora_A.weight`);
- `night`: a LoRA through PEFT, written in the kohya / Black Forest Labs layout that
  sd-scripts' FLUX.1 LoRAs have (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`,
  with `alpha`): BFL's fused q, k, v as one module whose down rows are the three downs and
  whose up is block-diagonal, which diffusers' kohya converter reads back exactly. Its
  single-block `linear1` (q, k, v and the MLP fused) is left out: that converter assumes
  FLUX.1's full-size widths there;
- `pastel`: a LoKr through LyCORIS (`lycoris_<module>.lokr_w1`, as LyCORIS writes FLUX.1 files);
- `big`: a DoRA through PEFT, written by `save_lora_weights` (with `lora_magnitude_vector`).
Each is trained from the distilled model on its own pictures with FLUX.1's flow-matching loss
at guidance 1, as FLUX.1-dev LoRAs are trained.
"""

import copy
import logging
import time

import torch
import torch.nn.functional as F
from diffusers import FluxPipeline

from loraswap.models.families import demo_flux

log = logging.getLogger("train_demo_flux")
RANK = 8
LOKR_FACTOR = 4  # the first Kronecker factor 4x4, the second (width / 4) square
STEPS = {"pastel": 1000}  # the LoKr learns slower; the others take 600
# every linear layer of the double- and single-stream blocks
BLOCK_LINEARS = (r".*blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                 r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|proj_mlp|proj_out|norm1?\.linear|norm1_context\.linear)")
# those the kohya/BFL layout can hold on a model of this size (no single-block linear1)
BFL_LINEARS = (r"(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
               r"|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))|single_transformer_blocks\.\d+\.proj_out)")
# BFL module of a double block -> the diffusers modules it fuses, in its row order
BFL_DOUBLE = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
              "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
              "img_attn_proj": ("attn.to_out.0",), "txt_attn_proj": ("attn.to_add_out",),
              "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",),
              "txt_mlp_0": ("ff_context.net.0.proj",), "txt_mlp_2": ("ff_context.net.2",)}
LYCORIS_PRESET = {"enable_conv": False, "target_module": ["FluxTransformerBlock", "FluxSingleTransformerBlock"],
                  "target_name": []}


def fit(transformer, parameters, data, steps: int | None, batch: int, lr: float, name: str) -> None:
    from train_demo_flux import lr_at, step

    steps = steps or STEPS.get(name, 600)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    ones = torch.ones(batch, device=data.device)
    transformer.train()
    for i in range(steps):
        b = data.sample(batch)
        loss = F.mse_loss(data.predict(transformer, b, ones), b["velocity"])
        step(optimizer, loss, lr_at(i, steps, lr, warm_up=50))
        if i % 200 == 0 or i == steps - 1:
            log.info("%s %d/%d loss %.4f", name, i, steps, loss.item())
    transformer.eval()


def train_peft(name: str, transformer, data, args, targets: str, dora: bool = False) -> tuple[dict, dict]:
    """A PEFT LoRA (or DoRA) of rank 8, alpha 8: its state dict in PEFT's names, and its config."""
    from peft import LoraConfig, get_peft_model_state_dict

    config = LoraConfig(r=RANK, lora_alpha=RANK, use_dora=dora, target_modules=targets, init_lora_weights="gaussian")
    transformer.add_adapter(config, adapter_name=name)
    parameters = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in parameters:
        p.requires_grad_(True)
    fit(transformer, parameters, data, args.adapter_steps, args.batch, 1e-3, name)
    layers = {k: v.detach().float().cpu() for k, v in get_peft_model_state_dict(transformer, adapter_name=name).items()}
    transformer.delete_adapters(name)
    return layers, config.to_dict()


def write_diffusers(name: str, layers: dict, config: dict, out) -> None:
    layers = {k: v.to(torch.float16) for k, v in layers.items()}
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=layers, weight_name=f"{name}.safetensors",
                                   transformer_lora_adapter_metadata=config)


def to_bfl(layers: dict, double_blocks: int, single_blocks: int) -> dict:
    """PEFT's names -> sd-scripts' FLUX.1 names; fused modules as one down of stacked rows and a
    block-diagonal up, alpha its rank (scale 1, as the PEFT LoRA's alpha / rank is)."""
    out = {}

    def put(bfl: str, modules: list[str]) -> None:
        downs = [layers.pop(f"{m}.lora_A.weight") for m in modules]
        ups = [layers.pop(f"{m}.lora_B.weight") for m in modules]
        out[f"lora_unet_{bfl}.lora_down.weight"] = torch.cat(downs)
        out[f"lora_unet_{bfl}.lora_up.weight"] = torch.block_diag(*ups)
        out[f"lora_unet_{bfl}.alpha"] = torch.tensor(float(RANK * len(modules)))

    for i in range(double_blocks):
        for bfl, modules in BFL_DOUBLE.items():
            put(f"double_blocks_{i}_{bfl}", [f"transformer_blocks.{i}.{m}" for m in modules])
    for i in range(single_blocks):
        put(f"single_blocks_{i}_linear2", [f"single_transformer_blocks.{i}.proj_out"])
    if layers:
        raise RuntimeError(f"not written in the BFL layout: {sorted(layers)}")
    return {k: v.to(torch.float16).contiguous() for k, v in out.items()}


def write_bfl(name: str, layers: dict, transformer, out) -> None:
    from safetensors.torch import save_file

    config = transformer.config
    tensors = to_bfl(dict(layers), config.num_layers, config.num_single_layers)
    save_file(tensors, str(out / f"{name}.safetensors"),
              {"ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1",
               "ss_network_dim": str(RANK), "ss_network_alpha": str(RANK)})


def train_lokr(name: str, transformer, data, args, out) -> None:
    """A LoKr through LyCORIS on every linear layer of the blocks, saved as LyCORIS saves it."""
    from lycoris import create_lycoris, wrapper

    wrapper.PRESET["demo-flux"] = LYCORIS_PRESET
    # both factors full (LyCORIS's full matrix mode, asked by a dim past any layer's): a
    # Kronecker product of factors of rank 8 has too little room to move colours
    network = create_lycoris(transformer, 1.0, linear_dim=100000, linear_alpha=1, algo="lokr", factor=LOKR_FACTOR,
                             preset="demo-flux")
    network.apply_to()
    network.to(data.device)
    fit(transformer, list(network.parameters()), data, args.adapter_steps, args.batch, 2e-3, name)
    network.save_weights(str(out / f"{name}.safetensors"), torch.float16,
                         {"ss_network_module": "lycoris.kohya", "ss_base_model_version": "flux1",
                          "ss_network_args": str({"algo": "lokr", "factor": LOKR_FACTOR, "full_matrix": True,
                                                  "preset": LYCORIS_PRESET})})
    network.restore()


def train_adapters(pipeline, sets: dict, flow_data, args, generator) -> None:
    out = args.out / "adapters"
    out.mkdir(parents=True, exist_ok=True)
    trained = pipeline.transformer.to(args.device).eval().requires_grad_(False)
    for name in args.adapter or demo_flux.DEMO_ADAPTERS:
        started = time.perf_counter()
        transformer = copy.deepcopy(trained)  # each library wraps the layers its own way: a fresh model each
        data = flow_data(pipeline, *sets[name], args.device, generator)
        if name == "outline":
            write_diffusers(name, *train_peft(name, transformer, data, args, BLOCK_LINEARS), out)
        elif name == "big":
            write_diffusers(name, *train_peft(name, transformer, data, args, BLOCK_LINEARS, dora=True), out)
        elif name == "night":
            write_bfl(name, train_peft(name, transformer, data, args, BFL_LINEARS)[0], transformer, out)
        else:
            train_lokr(name, transformer, data, args, out)
        log.info("adapter %s in %.0f s", name, time.perf_counter() - started)
