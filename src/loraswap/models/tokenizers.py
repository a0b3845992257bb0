"""Tokenizers made in code, so the tiny presets never touch a hub.

The CLIP tokenizer is a byte-level BPE without merges (one token per byte, with the
usual `</w>` end-of-word variants); the T5 tokenizer is a Unigram model over single
characters. Both are the real transformers classes, so pipelines call them exactly as
they call the tokenizers of the real models, and `save_pretrained` round-trips them.
"""

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, T5Tokenizer

CLIP_MAX_LENGTH = 77


def make_clip_tokenizer() -> CLIPTokenizer:
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def make_t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(33, 127)]
    pieces += [("▁" + chr(c), -2.5) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


CLIP_VOCAB_SIZE = 2 + 2 * 256
T5_VOCAB_SIZE = 4 + 2 * 94
