"""Stable Diffusion 3 and 3.5: an MMDiT flow transformer with three text encoders, CLIP-L,
CLIP-G (both with projections: their pooled outputs are concatenated) and T5-XXL.

The CLIP hidden states are concatenated, zero-padded to T5's width and put before T5's
tokens, so the transformer's context width is T5's. SD 3.5 Medium adds MMDiT-X blocks: a
second, image-only attention (`attn2`) in its first 13 blocks. Image inputs go through
SD3's img2img and inpainting pipelines, which share the loaded weights.
"""

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import CLIP_BIGG, CLIP_L, T5_XXL, TINY_VAE_BLOCKS, VAE_SD, tiny_clip_config, tiny_t5
from loraswap.models.tokenizers import make_clip_tokenizer, make_t5_tokenizer

# Two 32-wide CLIPs: a 64-wide pooled projection and a 64-wide context, T5's width (the
# real model pads CLIP's 2048 to T5's 4096). One dual-attention block and RMS q/k norms,
# as in SD 3.5. sample_size 8: the pipeline's default image is 8 * 8 = 64 pixels wide;
# pos_embed_max_size 64 lets it go up to 1024 pixels (latent / patch <= 64).
TINY_T5_WIDTH = 64
TINY_TRANSFORMER = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=TINY_T5_WIDTH,
                        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=64,
                        dual_attention_layers=(0,), qk_norm="rms_norm")
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# SD3's VAE: 16 latent channels, no quant convs (FLUX.1's layout), its own scale and shift
SD3_LATENTS = dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
                   shift_factor=0.0609)
VAE_SD3 = dict(VAE_SD, **SD3_LATENTS, sample_size=1024)


def tiny_sd3_vae() -> AutoencoderKL:
    return AutoencoderKL(**SD3_LATENTS, **TINY_VAE_BLOCKS)


def sd3_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """SD 3 and 3.5's scheduler: a fixed shift, no resolution-dependent one."""
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def _tokenizers() -> dict:
    return dict(tokenizer=make_clip_tokenizer(), tokenizer_2=make_clip_tokenizer(),
                tokenizer_3=make_t5_tokenizer(model_max_length=512))


def _tiny_sd3() -> StableDiffusion3Pipeline:
    # made in a fixed order: the seeded weights of each module depend on it
    transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
    text_encoder = CLIPTextModelWithProjection(tiny_clip_config(projection_dim=32))
    text_encoder_2 = CLIPTextModelWithProjection(tiny_clip_config(projection_dim=32))
    text_encoder_3 = tiny_t5(d_model=TINY_T5_WIDTH)
    vae = tiny_sd3_vae()
    return StableDiffusion3Pipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                                    text_encoder_2=text_encoder_2, text_encoder_3=text_encoder_3,
                                    scheduler=sd3_scheduler(), **_tokenizers())


def _sd3_extras() -> dict:
    return dict(scheduler=sd3_scheduler(), **_tokenizers(), image_encoder=None, feature_extractor=None)


SD35_MEDIUM_ARCHITECTURE = Architecture(
    components={"transformer": (SD3Transformer2DModel, SD35_MEDIUM),
                "text_encoder": (CLIPTextModelWithProjection, CLIP_L),
                "text_encoder_2": (CLIPTextModelWithProjection, CLIP_BIGG),
                "text_encoder_3": (T5EncoderModel, T5_XXL), "vae": (AutoencoderKL, VAE_SD3)},
    extras=_sd3_extras)

FAMILY = Family(
    name="sd3",
    pipeline="StableDiffusion3Pipeline",
    presets={"tiny-sd3": _tiny_sd3},
    architectures={"sd35-medium": SD35_MEDIUM_ARCHITECTURE},
    image_pipelines={"img2img": "StableDiffusion3Img2ImgPipeline", "inpaint": "StableDiffusion3InpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
)
