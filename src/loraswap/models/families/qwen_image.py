"""Qwen-Image: a 20B MMDiT of 60 double-stream blocks, conditioned on the last hidden state
of Qwen2.5-VL-7B, with a causal 3D VAE (Wan's layout: 16 latent channels, 8x down, one
frame; the latents are packed 2x2 for the transformer, so sizes go in multiples of 16).

Its guidance is true classifier-free guidance, `true_cfg_scale`, and it runs only when a
negative prompt comes (an empty one will do); the pipeline's `guidance_scale` feeds
guidance-distilled transformers (`guidance_embeds`), which Qwen-Image is not, so the
request's guidance goes to `true_cfg_scale`. Image inputs go through Qwen-Image's img2img
and inpainting pipelines, which share the loaded weights; Qwen-Image-Edit is its own
family (`qwen_image_edit.py`).
"""

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from loraswap.models.families.qwen_tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IMAGE_PAD_ID,
    QWEN_VOCAB_SIZE,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    make_qwen_tokenizer,
)
from loraswap.models.family import TINY_DEFAULTS, Architecture, Family

# The text encoder is 32 wide (the transformer's context width); 4 latent channels, packed
# 2x2 into 16. Rope over (frame, height, width) splits the head as the real one's 16/56/56.
TINY_TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
# Three downsamplings (8x, as the real one), the two last also in time (a no-op on one
# frame). No residual blocks in the encoder's levels (the decoder keeps one each): the edit
# pipeline encodes every input image at about 1024x1024, where one per level would add
# ~0.8 s an image on two CPU cores.
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0, temperal_downsample=[False, True, True],
                latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
# The token ids Qwen2.5-VL reads from its config: those of the tokenizer made in code
TOKEN_IDS = dict(image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
                 vision_end_token_id=VISION_END_ID)

QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
VAE_QWEN_IMAGE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True])  # with the class's latents_mean and _std, the real ones
QWEN2_5_VL_7B = Qwen2_5_VLConfig(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1e6,
                     use_sliding_window=False, sliding_window=32768, max_window_layers=28, hidden_act="silu",
                     bos_token_id=151643, eos_token_id=151645),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                       hidden_act="silu"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False)


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL, 32 wide, with a 16-wide vision tower (2 blocks, the second one attending
    over the whole image as the real tower's every eighth does)."""
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         rope_theta=1e6, bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=37, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        tie_word_embeddings=False, **TOKEN_IDS)
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's: shifted by image size (exponentially, up to 8192 tokens), and stretched
    so the last step ends at sigma 0.02."""
    return FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                           base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                           time_shift_type="exponential")


def tiny_qwen_image_components() -> dict:
    """The tiny Qwen-Image pipeline's modules (Qwen-Image-Edit builds the same). They are
    made in a fixed order: the seeded weights of each depend on it."""
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
    vae = AutoencoderKLQwenImage(**TINY_VAE)
    text_encoder = tiny_qwen2_5_vl()
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=make_qwen_tokenizer(),
                scheduler=qwen_image_scheduler())


def _tiny_qwen_image() -> QwenImagePipeline:
    return QwenImagePipeline(**tiny_qwen_image_components())


def qwen_image_extras() -> dict:
    return dict(scheduler=qwen_image_scheduler(), tokenizer=make_qwen_tokenizer())


QWEN_IMAGE_COMPONENTS = {"transformer": (QwenImageTransformer2DModel, QWEN_IMAGE),
                         "text_encoder": (Qwen2_5_VLForConditionalGeneration, QWEN2_5_VL_7B),
                         "vae": (AutoencoderKLQwenImage, VAE_QWEN_IMAGE)}
QWEN_IMAGE_ARCHITECTURE = Architecture(components=QWEN_IMAGE_COMPONENTS, extras=qwen_image_extras)

def guided_with_a_negative_prompt(kwargs: dict) -> dict:
    """A guidance scale is applied: Qwen-Image's true guidance runs only beside a negative
    prompt, so a request with a scale and no negative prompt gets a blank one."""
    if kwargs.get("true_cfg_scale", 1.0) > 1.0 and "negative_prompt" not in kwargs:
        return dict(kwargs, negative_prompt=[" "] * len(kwargs["prompt"]))
    return kwargs


FAMILY = Family(
    name="qwen-image",
    pipeline="QwenImagePipeline",
    presets={"tiny-qwen-image": _tiny_qwen_image},
    architectures={"qwen-image": QWEN_IMAGE_ARCHITECTURE},
    image_pipelines={"img2img": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline"},
    image_input="variants",
    defaults=TINY_DEFAULTS,
    call_names={"guidance_scale": "true_cfg_scale"},
    adjust_call=guided_with_a_negative_prompt,
)
