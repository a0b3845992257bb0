"""Tokenizers made in code, so the tiny presets never touch a hub.

The CLIP tokenizer is a byte-level BPE without merges (one token per byte, with the
usual `</w>` end-of-word variants); the T5 tokenizer is a Unigram model over single
characters. Both are the real transformers classes, so pipelines call them exactly as
they call the tokenizers of the real models, and `save_pretrained` round-trips them.

The trained demo models give each word of their vocabulary one token of its own
(`word_clip_tokenizer`, `word_t5_tokenizer`): a tokenizer that spells words letter by
letter leaves a tiny frozen text encoder too little to tell the prompts apart.
"""

from functools import cache

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


@cache
def word_clip_vocabulary(words: tuple[str, ...]) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """A CLIP BPE vocabulary whose merges spell each of `words` as one token, plus every byte
    and byte</w> so any other text still tokenizes. Built the same in every process: a trained
    text conditioning depends on each token's id."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    merges = _bpe_merges(sorted(set(words)))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return vocab, merges


def _bpe_merges(words: list[str]) -> tuple[tuple[str, str], ...]:
    """BPE as first described: merge the most frequent adjacent pair (ties: the smallest),
    until every word is one symbol. Applying the merges in this order spells each word whole."""
    spelled = [[*word[:-1], word[-1] + "</w>"] for word in words]
    merges = []
    while any(len(symbols) > 1 for symbols in spelled):
        counts: dict[tuple[str, str], int] = {}
        for symbols in spelled:
            for pair in zip(symbols, symbols[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        spelled = [_merge(symbols, best) for symbols in spelled]
    return tuple(merges)


def _merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def word_clip_tokenizer(words: tuple[str, ...]) -> CLIPTokenizer:
    vocab, merges = word_clip_vocabulary(words)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=CLIP_MAX_LENGTH)
    _check_whole(tokenizer, words)
    return tokenizer


def word_t5_tokenizer(words: tuple[str, ...], model_max_length: int) -> T5Tokenizer:
    """`make_t5_tokenizer`'s pieces, plus one piece per word (a Unigram model takes the
    likeliest spelling: one word piece beats three or more letters)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(33, 127)]
    pieces += [("▁" + chr(c), -2.5) for c in range(33, 127)]
    pieces += [("▁" + word, -1.0) for word in sorted(set(words)) if len(word) > 1]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
    _check_whole(tokenizer, words)
    return tokenizer


def _check_whole(tokenizer, words: tuple[str, ...]) -> None:
    split = [w for w in words if len(tokenizer.tokenize(w)) != 1]
    if split:  # the vocabulary must keep words whole, or the prompt cannot steer
        raise RuntimeError(f"the tokenizer splits {split}")
