"""What the swap and options benchmarks build: a random denoiser of a real architecture
(or a tiny preset's), its fixed inputs, adapters on disk, and the baselines driving it."""

from pathlib import Path

import torch

from loraswap.adapters.bound import ModelLayers
from loraswap.adapters.files.location import AdapterLocation
from loraswap.adapters.store import StoreLimits, TargetModel, read_adapter
from loraswap.bench.common import write_random_adapters
from loraswap.engine.swap.baselines import HotswapSwapper, LoadAndFuseSwapper
from loraswap.models import ARCHITECTURE_FAMILIES, architecture_denoiser, denoiser_name
from loraswap.models.architectures import build_architecture_component
from loraswap.models.presets import PRESETS, build_preset


def build_denoiser(architecture: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str, type]:
    """(denoiser, its component name, the pipeline class): a real architecture with random
    weights (`flux-dev`, `sdxl`, `sd15`, ...) or a tiny preset's denoiser (`tiny-sd`, ...)."""
    if architecture in PRESETS:
        pipeline = build_preset(architecture)
        prefix = denoiser_name(pipeline)
        return getattr(pipeline, prefix).to(device, dtype), prefix, type(pipeline)
    torch.manual_seed(0)
    prefix = architecture_denoiser(architecture)
    return (build_architecture_component(architecture, prefix, device=device, dtype=dtype), prefix,
            ARCHITECTURE_FAMILIES[architecture].pipeline_class)


# text tokens a denoiser call gets: FLUX.1's, FLUX.2's and Wan's pipelines pad the prompt to
# 512; Qwen-Image's passes the prompt's own length (a prompt of about 100 words here)
TEXT_TOKENS = {"QwenImageTransformer2DModel": 128}
PADDED_TEXT_TOKENS = 512


def denoiser_inputs(model: torch.nn.Module, width: int, height: int, device, dtype, frames: int = 33,
                    text_tokens: int | None = None) -> dict:
    """Fixed inputs of one denoiser call for one image (or a video of `frames` frames), as
    its pipeline passes them: FLUX.1, FLUX.2, Qwen-Image and Wan transformers, else a UNet
    with classifier-free guidance (batch 2). Random values, shapes from the model's config."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    family = type(getattr(model, "_orig_mod", model)).__name__  # (under torch.compile's wrapper)
    make = _INPUTS.get(family, _unet_inputs)
    text = text_tokens or TEXT_TOKENS.get(family, PADDED_TEXT_TOKENS)
    return make(model.config, width, height, frames, text, rand, device, dtype) | {"return_dict": False}


def _flux_inputs(config, width, height, frames, text, rand, device, dtype) -> dict:
    tokens = (height // 16) * (width // 16)  # (2x2 patches of 8x-downsampled latents)
    guidance = torch.tensor([3.5], device=device, dtype=dtype) if config.get("guidance_embeds") else None
    return dict(hidden_states=rand(1, tokens, config.in_channels),
                encoder_hidden_states=rand(1, text, config.joint_attention_dim),
                pooled_projections=rand(1, config.pooled_projection_dim),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                img_ids=torch.zeros(tokens, 3, device=device, dtype=dtype),
                txt_ids=torch.zeros(text, 3, device=device, dtype=dtype), guidance=guidance)


def _flux2_inputs(config, width, height, frames, text, rand, device, dtype) -> dict:
    from diffusers import Flux2Pipeline

    prompt = rand(1, text, config.joint_attention_dim)
    latent_ids = Flux2Pipeline._prepare_latent_ids(torch.empty(1, 1, height // 16, width // 16))
    return dict(hidden_states=rand(1, (height // 16) * (width // 16), config.in_channels),
                encoder_hidden_states=prompt, timestep=torch.tensor([0.5], device=device, dtype=dtype),
                guidance=torch.tensor([4.0], device=device) if config.get("guidance_embeds") else None,
                img_ids=latent_ids.to(device), txt_ids=Flux2Pipeline._prepare_text_ids(prompt).to(device))


def _qwen_image_inputs(config, width, height, frames, text, rand, device, dtype) -> dict:
    # (no mask: the pipeline drops an all-ones one)
    return dict(hidden_states=rand(1, (height // 16) * (width // 16), config.in_channels),
                encoder_hidden_states=rand(1, text, config.joint_attention_dim), encoder_hidden_states_mask=None,
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                img_shapes=[[(1, height // 16, width // 16)]])


def _wan_inputs(config, width, height, frames, text, rand, device, dtype) -> dict:
    latent_frames = (frames - 1) // 4 + 1  # 4x fewer frames (the first alone), 8x smaller
    return dict(hidden_states=rand(1, config.in_channels, latent_frames, height // 8, width // 8),
                timestep=torch.tensor([500], device=device), encoder_hidden_states=rand(1, text, config.text_dim))


def _unet_inputs(config, width, height, frames, text, rand, device, dtype) -> dict:
    inputs = dict(sample=rand(2, config.in_channels, height // 8, width // 8),
                  timestep=torch.tensor([500.0], device=device),
                  encoder_hidden_states=rand(2, 77, config.cross_attention_dim))
    if config.get("addition_embed_type") == "text_time":  # SDXL: pooled text and six time ids
        time_ids = 6 * config.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": rand(2, config.projection_class_embeddings_input_dim - time_ids),
                                       "time_ids": rand(2, 6)}
    return inputs


_INPUTS = {"FluxTransformer2DModel": _flux_inputs, "Flux2Transformer2DModel": _flux2_inputs,
           "QwenImageTransformer2DModel": _qwen_image_inputs, "WanTransformer3DModel": _wan_inputs}


def make_adapters(architecture: str, specs, workdir: Path, kohya_rank: int | None = 64) -> list[Path]:
    """Random adapters of real size (diffusers format; one kohya copy last, to time conversion)."""
    paths = write_random_adapters(architecture, specs, workdir)
    if kohya_rank:
        paths += write_random_adapters(architecture, [(kohya_rank, "all")], workdir, fmt="kohya", seed=99)
    return paths


def bound_reader(pipeline_cls: type, prefix: str, model: torch.nn.Module, layers: ModelLayers):
    """path -> the adapter read, converted and bound to `model`, as the adapter store does it."""
    # no base model to check against (name ""): the bench's random adapters declare none
    target = TargetModel("", pipeline_cls, layers, None, model.config if prefix == "unet" else None)
    device = next(model.parameters()).device
    return lambda path: read_adapter(DenoiserLoRA.location(path), target, StoreLimits(max_adapter_bytes=2**40), device)


class DenoiserLoRA:
    """A bare denoiser behind the pipeline LoRA methods the baselines call, so the bench
    measures the engine's own baseline swappers without text encoders or a VAE."""

    def __init__(self, model: torch.nn.Module, prefix: str):
        self.model, self.prefix = model, prefix
        setattr(self, prefix, model)  # the baselines find the denoiser as `transformer` or `unet`

    @staticmethod
    def location(path: Path) -> AdapterLocation:
        return AdapterLocation(path.stem, path, None)

    def load_lora_weights(self, source, adapter_name: str, hotswap: bool = False) -> None:
        self.model.load_lora_adapter(source, prefix=self.prefix, adapter_name=adapter_name, hotswap=hotswap)

    def enable_lora_hotswap(self, target_rank: int) -> None:
        self.model.enable_lora_hotswap(target_rank=target_rank)

    def set_adapters(self, names: list[str], weights: list[float]) -> None:
        self.model.set_adapters(names, weights)

    def fuse_lora(self, adapter_names: list[str]) -> None:
        self.model.fuse_lora(adapter_names=adapter_names)

    def unfuse_lora(self) -> None:
        self.model.unfuse_lora()

    def unload_lora_weights(self) -> None:
        self.model.unload_lora()


def make_baseline(name: str, target: DenoiserLoRA, target_rank: int):
    if name == "load-and-fuse":
        return LoadAndFuseSwapper(target)
    return HotswapSwapper(target, target_rank)
