"""Tiny random-weight text encoders and their tokenizers, made here: nothing is downloaded.

Owns the tokenizers (a vocabulary of the `tokenizers` package's byte-level alphabet and a fixed
corpus, handed to the `transformers` tokenizer class a pipeline loads, which saves it in its own
layout) and the
encoders (built from their `transformers` config classes with weights drawn from a fixed seed).
Called by `dlo_bench.serve_model`, which writes whole pipeline folders for the demo, the server
tests and `dlo bench serve`. Must not be imported by the planes.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

CORPUS = (
    "a red fox in the snow", "a lighthouse on a cliff at dusk", "a blue cat", "prompt 0",
    "prompt 1", "prompt 2", "an astronaut riding a horse", "the quick brown fox jumps over",
    "a bowl of fruit on a wooden table", "ocean waves under a full moon",
)
"""The words the vocabularies hold whole; any other text still encodes (byte-level BPE falls
back to bytes, Unigram to characters and `<unk>`)."""
CLIP_LENGTH = 77
"""CLIP's token count: the pipelines pad its prompts to the tokenizer's `model_max_length`."""
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Z-Image puts each prompt through the tokenizer's chat template (Qwen's turn markers)."""


class Tokenizer(str, Enum):
    """The tokenizer classes the tiny pipelines load, by the vocabulary each needs."""

    CLIP = "CLIPTokenizer"
    T5 = "T5TokenizerFast"
    QWEN = "Qwen2Tokenizer"


def make_tokenizer(kind: Tokenizer) -> Any:
    """A tokenizer of `kind` (its encoder's `vocab_size` is `len()` of it)."""
    import transformers

    cls = getattr(transformers, kind.value)
    if kind is Tokenizer.CLIP:
        vocab, merges = _bpe(["<|startoftext|>", "<|endoftext|>"], suffix="</w>")
        tokenizer = cls(vocab=vocab, merges=merges, model_max_length=CLIP_LENGTH)
    elif kind is Tokenizer.QWEN:
        vocab, merges = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], suffix=None)
        tokenizer = cls(vocab=vocab, merges=merges, model_max_length=512)
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    else:
        tokenizer = cls(vocab=_unigram(["<pad>", "</s>", "<unk>"]), model_max_length=512)
    return tokenizer


def _words() -> list[str]:
    return sorted({word for line in CORPUS for word in line.split()})


def _bpe(specials: list[str], suffix: str | None
         ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary: every byte, and each corpus word (CLIP's ending in `</w>`;
    otherwise also with its leading space, `Ġ`) merged from its characters left to right. Built
    by hand, not trained: the `tokenizers` trainers break ties in no fixed order, and every
    process must write the same folder."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(specials + alphabet)}
    if suffix:
        for char in alphabet:
            vocab[char + suffix] = len(vocab)
    merges: list[tuple[str, str]] = []
    spellings = [[*word[:-1], word[-1] + suffix] if suffix else list(word) for word in _words()]
    if not suffix:
        spellings += [["\u0120", word] for word in _words()]  # Ġ: the byte of a space
    for pieces in spellings:
        merged = pieces[0]
        for piece in pieces[1:]:
            pair, merged = (merged, piece), merged + piece
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append(pair)
    return vocab, merges


def _unigram(specials: list[str]) -> list[tuple[str, float]]:
    """A SentencePiece-style Unigram vocabulary: `<pad>`, `</s>` and `<unk>` first as T5 numbers
    them, the word start `▁`, printable ASCII, and each corpus word as one piece."""
    chars = [chr(code) for code in range(33, 127)]
    return ([(token, 0.0) for token in specials] + [("\u2581", -2.0)]
            + [(char, -5.0) for char in chars]
            + [("\u2581" + word, -1.0) for word in _words()])


class Encoder(str, Enum):
    """The text encoder classes of the tiny pipelines."""

    CLIP = "CLIPTextModel"
    CLIP_PROJECTION = "CLIPTextModelWithProjection"
    T5 = "T5EncoderModel"
    UMT5 = "UMT5EncoderModel"
    QWEN3 = "Qwen3Model"


def make_encoder(kind: Encoder, *, vocab_size: int, width: int, seed: int = 0,
                 projection: int | None = None) -> Any:
    """A two-layer encoder of `kind`, hidden size `width` (CLIP with projection: `projection`
    wide), weights from `seed`, in eval mode."""
    import transformers

    config = _config(kind, vocab_size, width, projection or width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, kind.value)(config)
    return model.eval()


def _config(kind: Encoder, vocab_size: int, width: int, projection: int) -> Any:
    import transformers as tf

    common = {"vocab_size": vocab_size, "num_hidden_layers": 2}
    if kind in (Encoder.CLIP, Encoder.CLIP_PROJECTION):
        return tf.CLIPTextConfig(**common, hidden_size=width, intermediate_size=2 * width,
                                 num_attention_heads=2, max_position_embeddings=CLIP_LENGTH,
                                 projection_dim=projection, bos_token_id=0, eos_token_id=1,
                                 pad_token_id=1)
    if kind is Encoder.QWEN3:
        return tf.Qwen3Config(**common, hidden_size=width, intermediate_size=2 * width,
                              num_attention_heads=2, num_key_value_heads=2, head_dim=width // 2,
                              max_position_embeddings=512)
    config_cls = tf.UMT5Config if kind is Encoder.UMT5 else tf.T5Config
    return config_cls(vocab_size=vocab_size, d_model=width, d_ff=2 * width, d_kv=width // 2,
                      num_layers=2, num_heads=2, relative_attention_num_buckets=8)
