"""FLUX.1 (dev and schnell): a flow transformer with CLIP-L and T5-XXL text encoders.

Image inputs go through FLUX.1's img2img and inpainting pipelines, which share the loaded
weights; FLUX.1 Kontext, the edit model, is its own family (`flux_kontext.py`).
"""

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, T5EncoderModel

from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import CLIP_L, T5_XXL, VAE_FLUX, tiny_clip, tiny_flux_vae, tiny_t5
from loraswap.models.tokenizers import make_clip_tokenizer, make_t5_tokenizer

TINY_TRANSFORMER = dict(patch_size=1, in_channels=16,  # 4 latent channels packed 2x2
                        num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                        axes_dims_rope=(4, 4, 8))
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


def tiny_flux_components() -> dict:
    """The tiny FLUX.1 pipeline's arguments (FLUX.1 Kontext builds the same). The modules are
    made in a fixed order: the seeded weights of each depend on it."""
    transformer = FluxTransformer2DModel(**TINY_TRANSFORMER)
    text_encoder_2 = tiny_t5()
    vae = tiny_flux_vae()
    return dict(transformer=transformer, vae=vae, text_encoder=tiny_clip(), text_encoder_2=text_encoder_2,
                tokenizer=make_clip_tokenizer(), tokenizer_2=make_t5_tokenizer(model_max_length=64),
                scheduler=FlowMatchEulerDiscreteScheduler())


def _tiny_flux() -> FluxPipeline:
    return FluxPipeline(**tiny_flux_components())


def flux_dev_extras() -> dict:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return dict(scheduler=scheduler, tokenizer=make_clip_tokenizer(),
                tokenizer_2=make_t5_tokenizer(model_max_length=512), image_encoder=None, feature_extractor=None)


FLUX_DEV_ARCHITECTURE = Architecture(
    components={"transformer": (FluxTransformer2DModel, FLUX_DEV), "text_encoder": (CLIPTextModel, CLIP_L),
                "text_encoder_2": (T5EncoderModel, T5_XXL), "vae": (AutoencoderKL, VAE_FLUX)},
    extras=flux_dev_extras)

FAMILY = Family(
    name="flux",
    pipeline="FluxPipeline",
    presets={"tiny-flux": _tiny_flux},
    architectures={"flux-dev": FLUX_DEV_ARCHITECTURE},
    image_pipelines={"img2img": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
)
