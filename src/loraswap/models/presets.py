"""Built-in tiny presets: the real diffusers pipeline classes with tiny configs.

Weights come from a fixed seed and the tokenizers are made in code, so every call
returns the same pipeline without any download. They exist for tests and for the
demo server: their images are noise, but every code path (text encoders, UNet or
transformer, VAE, scheduler, LoRA layouts) is the real one.
"""

from collections.abc import Callable

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from .tokenizers import CLIP_VOCAB_SIZE, T5_VOCAB_SIZE, make_clip_tokenizer, make_t5_tokenizer

SEED = 0

# A VAE with four blocks downsamples by 8, as the real ones do, so image sizes and
# latent shapes follow the same rules as on SD 1.5, SDXL and FLUX.1.
_VAE_BLOCKS = dict(
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    norm_num_groups=4,
    in_channels=3,
    out_channels=3,
    sample_size=64,
)


def _clip_config(hidden_size: int = 32, projection_dim: int | None = None) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=projection_dim or hidden_size,
        hidden_act="gelu",
    )


def _euler() -> EulerDiscreteScheduler:
    return EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)


# what the two tiny UNets share: two levels, one layer each, 8x8 latents (64x64 images)
_TINY_UNET = dict(block_out_channels=(16, 32), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
                  norm_num_groups=4)


def _tiny_sd() -> StableDiffusionPipeline:
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
    )
    vae = AutoencoderKL(latent_channels=4, **_VAE_BLOCKS)
    return StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=CLIPTextModel(_clip_config()),
        tokenizer=make_clip_tokenizer(),
        scheduler=_euler(),
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )


def _tiny_sdxl() -> StableDiffusionXLPipeline:
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80,  # 6 * 8 time ids + 32 pooled
        cross_attention_dim=64,
    )
    vae = AutoencoderKL(latent_channels=4, **_VAE_BLOCKS)
    return StableDiffusionXLPipeline(
        unet=unet,
        vae=vae,
        text_encoder=CLIPTextModel(_clip_config()),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(projection_dim=32)),
        tokenizer=make_clip_tokenizer(),
        tokenizer_2=make_clip_tokenizer(),
        scheduler=_euler(),
        force_zeros_for_empty_prompt=True,
    )


def _tiny_flux() -> FluxPipeline:
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=T5_VOCAB_SIZE,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    vae = AutoencoderKL(latent_channels=4, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035, **_VAE_BLOCKS)
    return FluxPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=CLIPTextModel(_clip_config()),
        text_encoder_2=t5,
        tokenizer=make_clip_tokenizer(),
        tokenizer_2=make_t5_tokenizer(model_max_length=64),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


# generation defaults of the presets: small images, few steps (pipelines' own defaults
# are sized for the real models, e.g. FLUX.1's 1024x1024 and 28 steps)
PRESET_DEFAULTS = {"width": 64, "height": 64, "steps": 4}

PRESETS: dict[str, Callable[[], DiffusionPipeline]] = {
    "tiny-sd": _tiny_sd,
    "tiny-sdxl": _tiny_sdxl,
    "tiny-flux": _tiny_flux,
}


def build_preset(name: str) -> DiffusionPipeline:
    """Build preset `name` with the same weights on every call (seeded, then scaled).

    Random init gives activations that blow up through the VAE; halving every weight
    keeps the tiny models numerically tame so relative comparisons mean something.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        pipeline = PRESETS[name]()
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.register_to_config(_name_or_path=name)
    return pipeline
