"""Z-Image (Turbo): a 6B single-stream transformer over image and caption tokens together,
conditioned on Qwen3-4B's second-to-last hidden state, with FLUX.1's VAE.

Before the 30 main blocks, the image tokens go through two `noise_refiner` blocks
(modulated by the timestep) and the caption tokens through two `context_refiner` blocks
(not modulated). Prompts are padded to 512 tokens for the text encoder, the padding then
dropped. `guidance_scale` is true classifier-free guidance (on above 0, a second pass with
the negative or empty prompt); Turbo is distilled to run without it, in 8 or 9 steps, but
the pipeline's defaults are 5.0 and 50 steps. Image inputs go through Z-Image's img2img
and inpainting pipelines, which share the loaded weights.
"""

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from loraswap.models.families.qwen_tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    QWEN3_CHAT_TEMPLATE,
    QWEN_VOCAB_SIZE,
    make_qwen_tokenizer,
)
from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import VAE_FLUX, tiny_flux_vae

# 4 latent channels (the tiny FLUX.1 VAE's), patchified 2x2 by the transformer itself;
# the caption width is the text encoder's. Rope splits the head over (caption position or
# frame, height, width) as the real one's 32/48/48, and keeps its table lengths, so any
# prompt (512 tokens) and size fit.
TINY_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32,
                        rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[1536, 512, 512])

Z_IMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
QWEN3_4B = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu", tie_word_embeddings=True,
                       bos_token_id=151643, eos_token_id=151645)


def tiny_qwen3() -> Qwen3Model:
    """Qwen3, 32 wide and 2 layers deep: the pipeline reads the second-to-last hidden state."""
    return Qwen3Model(Qwen3Config(vocab_size=QWEN_VOCAB_SIZE, hidden_size=32, intermediate_size=37,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                                  tie_word_embeddings=True, bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID))


def z_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Z-Image-Turbo's: a fixed shift of 3 (the pipeline's `mu` is unused without dynamic shifting)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def _tiny_z_image() -> ZImagePipeline:
    """The modules are made in a fixed order: the seeded weights of each depend on it."""
    transformer = ZImageTransformer2DModel(**TINY_TRANSFORMER)
    vae = tiny_flux_vae()
    text_encoder = tiny_qwen3()
    return ZImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder,
                          tokenizer=make_qwen_tokenizer(QWEN3_CHAT_TEMPLATE), scheduler=z_image_scheduler())


def z_image_extras() -> dict:
    return dict(scheduler=z_image_scheduler(), tokenizer=make_qwen_tokenizer(QWEN3_CHAT_TEMPLATE))


Z_IMAGE_ARCHITECTURE = Architecture(
    components={"transformer": (ZImageTransformer2DModel, Z_IMAGE_TURBO), "text_encoder": (Qwen3Model, QWEN3_4B),
                "vae": (AutoencoderKL, VAE_FLUX)},
    extras=z_image_extras)

FAMILY = Family(
    name="z-image",
    pipeline="ZImagePipeline",
    presets={"tiny-z-image": _tiny_z_image},
    architectures={"z-image": Z_IMAGE_ARCHITECTURE},
    image_pipelines={"img2img": "ZImageImg2ImgPipeline", "inpaint": "ZImageInpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
)
