"""Stable Diffusion 1.5: a UNet with one CLIP-L text encoder."""

from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel

from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import CLIP_L, TINY_VAE_BLOCKS, VAE_SD, euler, tiny_clip
from loraswap.models.tokenizers import make_clip_tokenizer

# what the tiny UNets of SD 1.5 and SDXL share: two levels, one layer each, 8x8 latents (64x64 images)
TINY_UNET = dict(block_out_channels=(16, 32), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
                 norm_num_groups=4)
UNET_SD15 = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
# the parts SD 1.5 pipelines take that loraswap does not serve
NO_SAFETY_CHECKER = dict(safety_checker=None, feature_extractor=None, image_encoder=None, requires_safety_checker=False)


def _tiny_sd() -> StableDiffusionPipeline:
    unet = UNet2DConditionModel(
        **TINY_UNET,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
    )
    return StableDiffusionPipeline(unet=unet, vae=AutoencoderKL(latent_channels=4, **TINY_VAE_BLOCKS),
                                   text_encoder=tiny_clip(), tokenizer=make_clip_tokenizer(), scheduler=euler(),
                                   **NO_SAFETY_CHECKER)


def _sd15_extras() -> dict:
    return dict(scheduler=euler(), tokenizer=make_clip_tokenizer(), **NO_SAFETY_CHECKER)


FAMILY = Family(
    name="sd15",
    pipeline="StableDiffusionPipeline",
    presets={"tiny-sd": _tiny_sd},
    architectures={"sd15": Architecture(components={"unet": (UNet2DConditionModel, UNET_SD15),
                                                    "text_encoder": (CLIPTextModel, CLIP_L),
                                                    "vae": (AutoencoderKL, VAE_SD)},
                                        extras=_sd15_extras)},
    image_pipelines={"img2img": "StableDiffusionImg2ImgPipeline", "inpaint": "StableDiffusionInpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
    size_multiple=8,
    strength_rounds_down=True,
)
