"""Megatron-LM's other tokenizers: SentencePiece (a `.model` file), TikToken (Megatron's JSON list of
ranks) and the NullTokenizer (space-separated ids). Same small interface as megalite.data.tokenizer:
vocab_size, eod, encode, encode_array, decode, name.

SentencePiece and tiktoken are optional packages (the [sentencepiece] and [tiktoken] extras), imported
only when such a tokenizer is asked for.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os

import numpy as np

from megalite.data.indexed_dataset import DataError, DataFileNotFoundError
from megalite.errors import one_line
from megalite.extras import require

# Megatron's two tiktoken split patterns (--tiktoken-pattern v1 | v2)
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
TIKTOKEN_SPECIAL = ("<unk>", "<s>", "</s>")  # the first ids; </s> is the end of document


def _digest(path: str, extra: str = "") -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read() + extra.encode()).hexdigest()[:16]


class SentencePieceTokenizer:
    """A SentencePiece `.model` file (Megatron's SentencePieceTokenizer / GPTSentencePieceTokenizer /
    Llama2Tokenizer). The end of document is the model's `</s>` (eos) id; a model without one gets a
    new id `vocab_size` (so vocab_size grows by one), as HFTokenizer does."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataFileNotFoundError(f"SentencePiece model {path!r} does not exist; pass the tokenizer's .model "
                                        f"file (--tokenizer-model)")
        sentencepiece = require("sentencepiece", f"--tokenizer-model {path}")
        self.path = os.path.abspath(path)
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as exc:  # noqa: BLE001 - the C++ side raises a plain RuntimeError/OSError
            raise DataError(f"{path!r} is not a SentencePiece model ({one_line(exc)}); pass the tokenizer's "
                            f".model file") from None
        pieces = self._model.get_piece_size()
        eos = self._model.eos_id()
        self._eod_is_extra = eos < 0
        self.eod = pieces if self._eod_is_extra else eos
        self.vocab_size = pieces + (1 if self._eod_is_extra else 0)
        self.name = f"sp-{_digest(path)}"

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._model.decode([int(i) for i in ids if int(i) != self.eod])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class TikTokenizer:
    """Megatron's TikTokenizer: a JSON list of {"rank", "token_bytes" (base64), "token_str"} (rank i at
    index i; the first 256 are the bytes), split by pattern v1 or v2. The first `num_special_tokens`
    ids are special (<unk>, <s>, </s>, then <SPECIAL_3>...), the ranks follow them; `vocab_size`
    keeps the first vocab_size - num_special_tokens ranks (None: all of them)."""

    def __init__(self, path: str, *, pattern: str = "v2", num_special_tokens: int = 1000,
                 vocab_size: int | None = None):
        tiktoken = require("tiktoken", "--tokenizer-type TikTokenizer")
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(f"--tiktoken-pattern {pattern!r}: choose v1 or v2")
        if num_special_tokens < len(TIKTOKEN_SPECIAL):
            raise DataError(f"--tiktoken-num-special-tokens {num_special_tokens}: at least {len(TIKTOKEN_SPECIAL)} "
                            f"({', '.join(TIKTOKEN_SPECIAL)})")
        ranks = _read_tiktoken_ranks(path, None if vocab_size is None else vocab_size - num_special_tokens)
        self.path = os.path.abspath(path)
        specials = {token: i for i, token in enumerate(TIKTOKEN_SPECIAL)}
        specials.update({f"<SPECIAL_{i}>": i for i in range(len(TIKTOKEN_SPECIAL), num_special_tokens)})
        self._model = tiktoken.Encoding(name=f"megalite-{os.path.basename(path)}", pat_str=TIKTOKEN_PATTERNS[pattern],
                                        mergeable_ranks={token: rank + num_special_tokens for token, rank in
                                                         ranks.items()}, special_tokens=specials)
        self.eod = specials["</s>"]
        self.vocab_size = num_special_tokens + len(ranks)
        self.name = f"tiktoken-{_digest(path, f'{pattern}:{num_special_tokens}:{self.vocab_size}')}"

    def encode(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._model.decode([int(i) for i in ids if int(i) != self.eod])

    def __repr__(self) -> str:
        return f"TikTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _read_tiktoken_ranks(path: str, max_ranks: int | None) -> dict[bytes, int]:
    """{token bytes: rank} of Megatron's tiktoken JSON; DataError naming what is wrong with the file."""
    if not os.path.isfile(path):
        raise DataFileNotFoundError(f"TikTokenizer vocabulary {path!r} does not exist; pass its JSON file "
                                    f"(--tokenizer-model)")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        if not isinstance(entries, list):
            raise ValueError(f"a JSON {type(entries).__name__}, not a list")
        entries = entries if max_ranks is None else entries[:max_ranks]
        ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"]) for entry in entries}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a TikTokenizer vocabulary ({one_line(exc)}); it is a JSON list of "
                        f"{{\"rank\", \"token_bytes\", \"token_str\"}}") from None
    if sorted(ranks.values()) != list(range(len(entries))):
        raise DataError(f"{path}: ranks are not 0..{len(entries) - 1}, each once; not a TikTokenizer vocabulary")
    return ranks


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated ids below `vocab_size` (--vocab-size); the end of
    document is one more id, so the vocabulary is vocab_size + 1."""

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise DataError(f"--vocab-size {vocab_size}: NullTokenizer needs a vocabulary of 1 or more ids")
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.name = f"null-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise DataError(f"NullTokenizer reads space-separated integer ids, not {text[:40]!r}") from None
        if any(not 0 <= i < self.eod for i in ids):
            raise DataError(f"NullTokenizer: an id outside 0..{self.eod - 1} (--vocab-size {self.eod}) in "
                            f"{text[:40]!r}")
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids if int(i) != self.eod)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"
