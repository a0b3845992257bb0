"""FLUX.2 [dev]: a flow transformer with one text encoder, Mistral Small 3.1 (Mistral3).

The pipeline takes reference images through its own optional `image` (they are encoded
by the VAE and attended to beside the latents), so FLUX.2 is an edit family without
image pipelines. Prompts are encoded by stacking three of the text encoder's hidden
states (layers 10, 20 and 30 by default), so its context width is 3x the encoder's.
"""

import math

from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PreTrainedTokenizerFast

from loraswap.models.family import TINY_DEFAULTS, Architecture, Family
from loraswap.models.parts import TINY_VAE_BLOCKS

# Tekken's (Mistral's tokenizer's) first special tokens, at their real ids, so the image
# token (10) and the padding token (11) are those the real Mistral3 config names.
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                          "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[TOOL_CONTENT]")
MISTRAL_VOCAB_SIZE = len(MISTRAL_SPECIAL_TOKENS) + 256  # the specials, then one token per byte
MISTRAL_IMAGE_TOKEN = MISTRAL_SPECIAL_TOKENS.index("[IMG]")

# Mistral Small 3.1's chat template, shortened to what the pipeline sends: a system
# message, then user messages whose content is a list of text (and image) parts.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

# Stacking 3 hidden states of a 16-wide encoder: a 48-wide context. The latents have 4
# channels, packed 2x2 into 16.
TINY_TRANSFORMER = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4))
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True)
VAE_FLUX2 = dict(in_channels=3, out_channels=3, latent_channels=32, block_out_channels=(128, 256, 512, 512),
                 layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, sample_size=1024,
                 use_quant_conv=True, use_post_quant_conv=True, batch_norm_eps=1e-4, patch_size=(2, 2))
MISTRAL_SMALL_3_1 = Mistral3Config(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                     hidden_act="silu", tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, hidden_act="silu"),
    image_token_index=10, spatial_merge_size=2, projector_hidden_act="gelu", vision_feature_layer=-1,
    multimodal_projector_bias=False, tie_word_embeddings=False)  # its lm_head is a weight of its own


def make_mistral_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with Mistral's special tokens and chat template.

    It stands in for the `PixtralProcessor` the real pipeline loads: that class refuses
    to build without torchvision, and the pipeline only needs `apply_chat_template` on
    text prompts (images reach the VAE, not the text encoder, unless prompts are
    upsampled). No merges: one token per byte, enough for FLUX.2's short system message
    and a prompt within the pipeline's 512 tokens.
    """
    vocab = {token: index for index, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(MISTRAL_SPECIAL_TOKENS))  # so "[INST]" is one token, not 6 bytes
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=model_max_length,
                                   chat_template=MISTRAL_CHAT_TEMPLATE)


def tiny_mistral3() -> Mistral3ForConditionalGeneration:
    """Mistral3, tiny but 30 layers deep: the pipeline reads hidden states 10, 20 and 30
    and has no setting for them but a call argument the server does not pass."""
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=MISTRAL_VOCAB_SIZE, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=512, rope_theta=1e9, sliding_window=None,
                         tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=56, patch_size=14, hidden_act="silu"),
        image_token_index=MISTRAL_IMAGE_TOKEN, spatial_merge_size=2, tie_word_embeddings=False)
    return Mistral3ForConditionalGeneration(config)


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    """FLUX.2's VAE layout (quant convs, batch-norm statistics over 2x2 patches), tiny."""
    return AutoencoderKLFlux2(latent_channels=4, **TINY_VAE_BLOCKS)


def flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.2 [dev]'s scheduler (FLUX.1 [dev]'s config); the pipeline passes it a `mu`."""
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def _tiny_flux2() -> Flux2Pipeline:
    return Flux2Pipeline(transformer=Flux2Transformer2DModel(**TINY_TRANSFORMER), vae=tiny_flux2_vae(),
                         text_encoder=tiny_mistral3(), tokenizer=make_mistral_tokenizer(), scheduler=flux2_scheduler())


def flux2_dev_extras() -> dict:
    return dict(scheduler=flux2_scheduler(), tokenizer=make_mistral_tokenizer())


FLUX2_DEV_ARCHITECTURE = Architecture(
    components={"transformer": (Flux2Transformer2DModel, FLUX2_DEV),
                "text_encoder": (Mistral3ForConditionalGeneration, MISTRAL_SMALL_3_1),
                "vae": (AutoencoderKLFlux2, VAE_FLUX2)},
    extras=flux2_dev_extras)

def edit_tokens(kwargs: dict, patch: int) -> int:
    """The transformer's sequence for a call with reference images: the output's tokens (the
    asked size, else the first image's, as the pipeline makes it) and each image's, scaled
    down to 1 MP if larger, then cut down to multiples of `patch` pixels (a token each)."""
    images = kwargs["image"] if isinstance(kwargs["image"], list) else [kwargs["image"]]
    sides = []
    for image in images:
        width, height = image.size
        if width * height > 1024 * 1024:
            scale = math.sqrt(1024 * 1024 / (width * height))
            width, height = int(width * scale), int(height * scale)
        sides.append((width // patch, height // patch))
    width = kwargs["width"] // patch if kwargs.get("width") else sides[0][0]
    height = kwargs["height"] // patch if kwargs.get("height") else sides[0][1]
    return width * height + sum(w * h for w, h in sides)


FAMILY = Family(
    name="flux2",
    pipeline="Flux2Pipeline",
    presets={"tiny-flux2": _tiny_flux2},
    architectures={"flux2-dev": FLUX2_DEV_ARCHITECTURE},
    image_input="edit",
    defaults=TINY_DEFAULTS,
    edit_tokens=edit_tokens,
)
