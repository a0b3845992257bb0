"""Qwen-Image-Edit: Qwen-Image's architecture trained to edit. The input image goes to the
VAE (its latents are attended to beside the noise) and, through Qwen2.5-VL's processor, to
the text encoder with the instruction.

The pipeline cannot run without an image (it reads the image's size first), so the family
requires one. Whatever the output size, it resizes the image to about 1024x1024 (aspect
kept) for both: ~4096 image-latent tokens in each transformer pass, and at the processor's
limits 1369 vision tokens in the prompt. Guidance is `true_cfg_scale`, as Qwen-Image's.
"""

from diffusers import QwenImageEditPipeline

from loraswap.models.families.qwen_image import (
    QWEN_IMAGE_COMPONENTS,
    guided_with_a_negative_prompt,
    qwen_image_extras,
    tiny_qwen_image_components,
)
from loraswap.models.families.qwen_tokenizer import make_qwen2_vl_processor
from loraswap.models.family import TINY_DEFAULTS, Architecture, Family

# The tiny processor caps the image at 112x112 for the vision tower (16 tokens), where the
# real one takes it as it comes (up to 12.8 megapixels)
TINY_MAX_PIXELS = 112 * 112


def _tiny_qwen_image_edit() -> QwenImageEditPipeline:
    return QwenImageEditPipeline(**tiny_qwen_image_components(), processor=make_qwen2_vl_processor(TINY_MAX_PIXELS))


def qwen_image_edit_extras() -> dict:
    return dict(qwen_image_extras(), processor=make_qwen2_vl_processor())


QWEN_IMAGE_EDIT_ARCHITECTURE = Architecture(components=QWEN_IMAGE_COMPONENTS, extras=qwen_image_edit_extras)

FAMILY = Family(
    name="qwen-image-edit",
    pipeline="QwenImageEditPipeline",
    presets={"tiny-qwen-image-edit": _tiny_qwen_image_edit},
    architectures={"qwen-image-edit": QWEN_IMAGE_EDIT_ARCHITECTURE},
    image_input="required",
    defaults=TINY_DEFAULTS,
    call_names={"guidance_scale": "true_cfg_scale"},
    adjust_call=guided_with_a_negative_prompt,
)
