"""Tokenizers: the built-in byte-level tokenizer and a wrapper for a local HF `tokenizer.json`.

Both expose one small interface used by preprocessing and training:

    vocab_size: int         size of the embedding table the model needs
    eod: int                end-of-document id, appended after every document
    encode(text) -> list[int]
    decode(ids) -> str
    name: str               stable identity (part of cache keys)

Nothing is ever downloaded: a HF tokenizer is read from a file on disk through the optional
`tokenizers` package, imported only when such a file is given.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from megalite.data.indexed_dataset import DataError, DataFileNotFoundError
from megalite.errors import one_line
from megalite.extras import require


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, id 256 is the end-of-document token."""

    vocab_size = 257
    eod = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path used by preprocessing: the ids as a uint8 array (no Python list)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) != self.eod)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eod=256)"


class HFTokenizer:
    """A HuggingFace `tokenizer.json` read from disk (needs the `tokenizers` package).

    The end-of-document id is the first special token found among common EOS names
    (`<|endoftext|>`, `</s>`, `<eos>`, `<|end_of_text|>`, `[SEP]`); when the file has none,
    a new id `vocab_size` is reserved for it (so vocab_size grows by one).
    """

    EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")

    def __init__(self, path: str):
        if os.path.isdir(path):  # a saved HuggingFace tokenizer directory (Megatron's HuggingFaceTokenizer takes one)
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise DataFileNotFoundError(f"tokenizer directory {path!r} holds no tokenizer.json; save the tokenizer "
                                            f"with save_pretrained (fast tokenizers write tokenizer.json), or pass "
                                            f"'byte' for the byte tokenizer")
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataFileNotFoundError(f"tokenizer file {path!r} does not exist; pass a path to a "
                                        f"HuggingFace tokenizer.json, or 'byte' for the byte tokenizer")
        Tokenizer = require("tokenizers", f"--tokenizer {path}").Tokenizer  # the [hf] extra; or --tokenizer byte
        self.path = os.path.abspath(path)
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises a plain Exception for any bad file
            raise DataError(f"tokenizer file {path!r} is not a HuggingFace tokenizer.json ({one_line(exc)}); pass "
                            f"the tokenizer.json saved with the tokenizer, or 'byte' for the byte tokenizer") from None
        base_vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eod = None
        for token in self.EOD_NAMES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                eod = token_id
                break
        self._eod_is_extra = eod is None  # then no text maps to it; decode drops it
        self.eod = base_vocab if eod is None else eod
        self.vocab_size = base_vocab + (1 if eod is None else 0)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        self.name = f"hf-{digest}"

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Many texts in one call (the Rust side batches them): used by preprocessing."""
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if not (self._eod_is_extra and int(i) == self.eod)]
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def load_tokenizer(spec: str | None):
    """None or "byte" -> ByteTokenizer; a path to a HF tokenizer.json -> HFTokenizer."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    if not isinstance(spec, str):
        raise TypeError(f"tokenizer spec must be None, 'byte' or a path, got {type(spec).__name__}")
    return HFTokenizer(spec)


def bpe_files_to_json(vocab_file: str, merge_file: str, cache_dir: str | None = None) -> str:
    """A tokenizer.json of GPT-2-style byte-level BPE files (Megatron's GPT2BPETokenizer: vocab.json +
    merges.txt), written once per pair of contents under `cache_dir` (default ~/.cache/megalite/tokenizers;
    atomic, so ranks writing it together agree); returns its path."""
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            raise DataFileNotFoundError(f"{flag} {path!r} does not exist; pass GPT-2's vocab.json / merges.txt")
    tokenizers = require("tokenizers", "--vocab-file/--merge-file")
    digest = hashlib.sha256()
    for path in (vocab_file, merge_file):
        with open(path, "rb") as f:
            digest.update(f.read())
    directory = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megalite", "tokenizers")
    target = os.path.join(directory, f"gpt2bpe-{digest.hexdigest()[:16]}.json")
    if os.path.isfile(target):
        return target
    try:
        model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises a plain Exception for a bad file
        raise DataError(f"--vocab-file {vocab_file!r} / --merge-file {merge_file!r} are not GPT-2 BPE files "
                        f"({one_line(exc)})") from None
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    os.makedirs(directory, exist_ok=True)
    temporary = f"{target}.tmp-{os.getpid()}"
    tokenizer.save(temporary)
    os.replace(temporary, target)
    return target
