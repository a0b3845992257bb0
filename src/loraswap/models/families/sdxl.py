"""Stable Diffusion XL: a UNet with two CLIP text encoders (L and bigG) and micro-conditioning."""

from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from loraswap.models.families.sd15 import TINY_UNET
from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import CLIP_BIGG, CLIP_L, TINY_VAE_BLOCKS, VAE_SD, euler, tiny_clip, tiny_clip_config
from loraswap.models.tokenizers import make_clip_tokenizer

UNET_SDXL = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
                 transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816,
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))


def _tiny_sdxl() -> StableDiffusionXLPipeline:
    unet = UNet2DConditionModel(
        **TINY_UNET,
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
    return StableDiffusionXLPipeline(
        unet=unet,
        vae=AutoencoderKL(latent_channels=4, **TINY_VAE_BLOCKS),
        text_encoder=tiny_clip(),
        text_encoder_2=CLIPTextModelWithProjection(tiny_clip_config(projection_dim=32)),
        tokenizer=make_clip_tokenizer(),
        tokenizer_2=make_clip_tokenizer(),
        scheduler=euler(),
        force_zeros_for_empty_prompt=True,
    )


def _sdxl_extras() -> dict:
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                       steps_offset=1, timestep_spacing="leading")
    return dict(scheduler=scheduler, tokenizer=make_clip_tokenizer(), tokenizer_2=make_clip_tokenizer(),
                image_encoder=None, feature_extractor=None)


SDXL_ARCHITECTURE = Architecture(
    components={"unet": (UNet2DConditionModel, UNET_SDXL), "text_encoder": (CLIPTextModel, CLIP_L),
                "text_encoder_2": (CLIPTextModelWithProjection, CLIP_BIGG),
                "vae": (AutoencoderKL, dict(VAE_SD, scaling_factor=0.13025, sample_size=1024))},
    extras=_sdxl_extras)

FAMILY = Family(
    name="sdxl",
    pipeline="StableDiffusionXLPipeline",
    presets={"tiny-sdxl": _tiny_sdxl},
    architectures={"sdxl": SDXL_ARCHITECTURE},
    image_pipelines={"img2img": "StableDiffusionXLImg2ImgPipeline", "inpaint": "StableDiffusionXLInpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
    size_multiple=8,
    strength_rounds_down=True,
)
