"""Small text corpora and a BPE tokenizer trained on them in the test (``tokenizers``, well under a second)."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
WORDS = ("the quick brown fox jumps over a lazy dog while shards gather and gradients reduce "
         "into one global batch of tokens per step").split()


def documents(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + rng.choice([".", "!\n", ""])
            for _ in range(n)]


def train_tokenizer(path: Path, texts: list[str], vocab_size: int = 300, eos: str | None = EOS) -> Path:
    """A byte-level BPE ``tokenizer.json`` (256 byte tokens, ``eos`` as id 0, merges up to ``vocab_size``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos] if eos else [], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def expected_stream(tokenizer_json: Path, texts: list[str]) -> list[int]:
    """What packing must give: each non-empty document's ids, then EOS, in order (computed independently)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS)
    stream = []
    for text in texts:
        if text:
            stream += tok.encode(text).ids + [eos]
    return stream
