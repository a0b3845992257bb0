"""Qwen's tokenizers and Qwen2-VL's processor, made in code (no hub), for the Qwen-Image,
Qwen-Image-Edit and Z-Image families.

The tokenizer is the real `Qwen2Tokenizer` (byte-level BPE behind Qwen2's pre-tokenizer)
with a small vocabulary: the special tokens the pipelines send, one token per byte, and
merges that make each word of the pipelines' system prompts one token, as Qwen's own
vocabulary does. Qwen-Image drops a fixed number of leading tokens from the encoded prompt
(34; 64 for the edit model), meant to be the system prompt: with these merges they are
exactly that. Any other text is tokenized byte by byte.
"""

import functools

from tokenizers import Regex, models, pre_tokenizers
from transformers import ProcessorMixin, Qwen2Tokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor  # noqa: F401
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

# Qwen's special tokens, in the order of their ids in the real vocabulary (which puts them
# after the ordinary tokens; here they come first, at fixed ids)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Qwen3's reasoning markers: added tokens but not special ones, as in Qwen3's vocabulary
THINK_TOKENS = ("<think>", "</think>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, _, IMAGE_PAD_ID, VIDEO_PAD_ID = range(
    len(QWEN_SPECIAL_TOKENS))

# The system prompts of diffusers' Qwen-Image and Qwen-Image-Edit pipelines, whose words
# become single tokens; and Qwen2.5-VL's default one (its chat template's)
SYSTEM_PROMPTS = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:",
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.",
    "You are a helpful assistant.",
)
ROLES = ("system", "user", "assistant")

# Qwen2.5-VL's chat template, shortened to messages of text and image or video parts
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's chat template, shortened to text messages (no tools); Z-Image asks for
# `enable_thinking=True`, which adds nothing to the generation prompt
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# Qwen2.5-VL's image processor settings (its `preprocessor_config.json`)
VL_MIN_PIXELS, VL_MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's: its regex split, then bytes as printable characters (`Qwen2Tokenizer`'s)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@functools.cache
def _vocab_and_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """The specials, one token per byte, then a token per word of the system prompts.

    Each word gets the merges that join its pieces left to right, the pieces being what
    the merges so far make of it; a word already merged stays one token whatever comes
    after, so every word ends as one token.
    """
    vocab = {token: index for index, token in enumerate(QWEN_SPECIAL_TOKENS + THINK_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges: list[tuple[str, str]] = []
    words = [word for text in SYSTEM_PROMPTS + ROLES + ("\n",) for word, _ in _pre_tokenizer().pre_tokenize_str(text)]
    for word in dict.fromkeys(words):
        pieces = [token.value for token in models.BPE(vocab=dict(vocab), merges=list(merges)).tokenize(word)]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(merged, len(vocab))
            pieces[:2] = [merged]
    return vocab, tuple(merges)


QWEN_VOCAB_SIZE = len(_vocab_and_merges()[0])


def make_qwen_tokenizer(chat_template: str = QWEN2_VL_CHAT_TEMPLATE) -> Qwen2Tokenizer:
    """Qwen2.5-VL's tokenizer (Qwen-Image's), or with `QWEN3_CHAT_TEMPLATE` Qwen3's (Z-Image's).

    Special tokens as the real ones: no unknown or start token, `<|im_end|>` ends, and
    `<|endoftext|>` pads.
    """
    vocab, merges = _vocab_and_merges()
    tokenizer = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
                               model_max_length=131072, chat_template=chat_template)
    tokenizer.add_tokens(list(THINK_TOKENS))
    return tokenizer


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor: transformers builds that one on
    torchvision (absent here) and checks every sub-processor's class, even a None one. The
    pipelines send images, never videos; for images this is `Qwen2VLProcessor` itself.

    A saved pipeline names this class by its module; diffusers loads such a component by
    the base classes that module exposes, hence `ProcessorMixin` imported here.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # the parent passes its video processor on positionally; ProcessorMixin pairs the
        # arguments with this class's sub-processors (image and tokenizer) and drops it
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def make_qwen2_vl_processor(max_pixels: int = VL_MAX_PIXELS) -> Qwen2VLProcessor:
    """Qwen2.5-VL's processor: the image processor (a config, no weights), the tokenizer and
    the chat template. Images are resized to between `VL_MIN_PIXELS` and `max_pixels` pixels,
    in multiples of 28 (14-pixel patches; 2x2 patches make one token).

    The PIL image processor stands in for the default one, which needs torchvision; both
    cut the same patches.
    """
    image_processor = Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=max_pixels, patch_size=14,
                                               temporal_patch_size=2, merge_size=2)
    return Qwen2VLImageProcessorOnly(image_processor=image_processor, tokenizer=make_qwen_tokenizer(),
                                     chat_template=QWEN2_VL_CHAT_TEMPLATE)
