"""Small corpora for the data tests (kept tiny: the whole tests/data budget is seconds)."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from megalite.data import ByteTokenizer, IndexedDatasetWriter


def random_texts(count: int, seed: int, min_len: int = 1, max_len: int = 200) -> list[str]:
    """Texts with ASCII, accents and emoji, so multi-byte UTF-8 is exercised."""
    rng = random.Random(seed)
    alphabet = "abcdefghij klmnop\nqrstuv.,;éüß€😀"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))) for _ in range(count)]


def write_jsonl(path: str, texts: list[str], key: str = "text") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text, "other": "x"}) + "\n")


def write_byte_dataset(prefix: str, texts: list[str]) -> list[np.ndarray]:
    """Write texts (with eod) straight through the writer; return each document's tokens."""
    tokenizer = ByteTokenizer()
    writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size, tokenizer.eod)
    docs = []
    for text in texts:
        doc = np.append(tokenizer.encode_array(text).astype(np.int64), tokenizer.eod)
        writer.add_document(doc)
        docs.append(doc)
    writer.finalize()
    return docs


def make_dirs(*paths: str) -> None:
    for path in paths:
        os.makedirs(path, exist_ok=True)


def tiny_tokenizer_json(path, with_eos: bool):
    """Train a tiny BPE tokenizer here and save it as a tokenizer.json (nothing downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]"] + (["<|endoftext|>"] if with_eos else [])
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=special, show_progress=False)
    tok.train_from_iterator(["the cat sat on the mat", "a dog ate the cat food"] * 5, trainer)
    tok.save(str(path))
    return tok
