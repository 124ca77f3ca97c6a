"""Tokenizers: the built-in byte-level tokenizer, a wrapper for a local HF `tokenizer.json` (or a HF
directory), and the spec string that names any of megalite's tokenizers (`load_tokenizer`).

All expose one small interface used by preprocessing and training:

    vocab_size: int         size of the embedding table the model needs
    eod: int                end-of-document id, appended after every document
    encode(text) -> list[int]
    decode(ids) -> str
    name: str               stable identity (part of cache keys)

Nothing is ever downloaded: a HF tokenizer is read from a file on disk through the optional
`tokenizers` package, imported only when such a file is given.

A tokenizer spec (the --tokenizer setting; Megatron's --tokenizer-type flags are turned into one by
megalite.config.megatron.tokenizer_from_megatron) is one of:

    byte (or None)                     the byte tokenizer
    PATH/tokenizer.json, or DIRECTORY  HuggingFace (a directory: its tokenizer.json, else its tokenizer.model)
    PATH.model, sentencepiece:PATH     SentencePiece (megalite.data.megatron_tokenizers)
    tiktoken:PATTERN:SPECIAL:VOCAB:PATH  Megatron's TikTokenizer (VOCAB an int or "all")
    null:N                             Megatron's NullTokenizer over N ids
"""
from __future__ import annotations

import enum
import hashlib
import json
import os

import numpy as np

from megalite.data.indexed_dataset import DataError, DataFileNotFoundError
from megalite.data.megatron_tokenizers import NullTokenizer, SentencePieceTokenizer, TikTokenizer
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

    def __init__(self, path: str, eos_token: str | None = None):
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
        for token in ((eos_token,) if eos_token else ()) + self.EOD_NAMES:  # the directory's own eos first
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                eod = token_id
                break
        self._eod_is_extra = eod is None  # then no text maps to it; decode drops it
        self.eod = base_vocab if eod is None else eod
        self.vocab_size = base_vocab + (1 if eod is None else 0)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read() + (eos_token or "").encode()).hexdigest()[:16]
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


class TokenizerKind(enum.Enum):
    BYTE = "byte"
    HF_FILE = "hf-file"
    HF_DIRECTORY = "hf-directory"
    SENTENCEPIECE = "sentencepiece"
    TIKTOKEN = "tiktoken"
    NULL = "null"


def parse_tokenizer_spec(spec: str | None) -> tuple[TokenizerKind, str]:
    """(kind, the rest of the spec: a path, or N for null, or PATTERN:SPECIAL:VOCAB:PATH for tiktoken)."""
    if spec is None or spec == "byte":
        return TokenizerKind.BYTE, ""
    if not isinstance(spec, str):
        raise TypeError(f"tokenizer spec must be None, 'byte' or a path, got {type(spec).__name__}")
    kind, _, rest = spec.partition(":")
    if kind in ("null", "sentencepiece", "tiktoken") and rest:
        return TokenizerKind(kind), rest
    if os.path.isdir(spec):
        return TokenizerKind.HF_DIRECTORY, spec
    if spec.endswith(".model"):
        return TokenizerKind.SENTENCEPIECE, spec
    return TokenizerKind.HF_FILE, spec


def load_tokenizer(spec: str | None):
    """The tokenizer a spec names (see the module's docstring); DataError / DataFileNotFoundError (one
    line) for a spec that names nothing usable, MissingExtraError for a package not installed."""
    kind, rest = parse_tokenizer_spec(spec)
    if kind is TokenizerKind.BYTE:
        return ByteTokenizer()
    if kind is TokenizerKind.HF_FILE:
        return HFTokenizer(rest)
    if kind is TokenizerKind.HF_DIRECTORY:
        return _directory_tokenizer(rest)
    if kind is TokenizerKind.SENTENCEPIECE:
        return SentencePieceTokenizer(rest)
    if kind is TokenizerKind.NULL:
        if not rest.isdigit():
            raise DataError(f"tokenizer {spec!r}: NullTokenizer takes a number of ids (null:N, --vocab-size N)")
        return NullTokenizer(int(rest))
    pattern, special, vocab, path = (rest.split(":", 3) + ["", "", ""])[:4]
    if not special.isdigit() or not (vocab == "all" or vocab.isdigit()) or not path:
        raise DataError(f"tokenizer {spec!r}: a TikTokenizer spec is tiktoken:PATTERN:SPECIAL:VOCAB:PATH")
    return TikTokenizer(path, pattern=pattern, num_special_tokens=int(special),
                        vocab_size=None if vocab == "all" else int(vocab))


def _directory_tokenizer(directory: str):
    """A HuggingFace tokenizer directory (what save_pretrained writes): its tokenizer.json, with the eos
    token its tokenizer_config.json names as the end of document; else its SentencePiece tokenizer.model."""
    file = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(file):
        return HFTokenizer(file, eos_token=_configured_eos(directory))
    if os.path.isfile(os.path.join(directory, "tokenizer.model")):
        return SentencePieceTokenizer(os.path.join(directory, "tokenizer.model"))
    raise DataFileNotFoundError(f"tokenizer directory {directory!r} holds no tokenizer.json (nor a SentencePiece "
                                f"tokenizer.model); pass the directory the tokenizer was saved to")


def _configured_eos(directory: str) -> str | None:
    """The eos token tokenizer_config.json names (a string, or {"content": ...}); None without one."""
    path = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def tokenizer_spec_problem(spec: str | None) -> str | None:
    """A spec whose file is missing, as one line for the config check (None when it names files that exist)."""
    kind, rest = parse_tokenizer_spec(spec)
    path = {TokenizerKind.HF_FILE: rest, TokenizerKind.SENTENCEPIECE: rest,
            TokenizerKind.TIKTOKEN: rest.split(":", 3)[-1]}.get(kind)
    if path is not None and not os.path.isfile(path):
        return (f"--tokenizer {path}: no such file; give a tokenizer.json, a tokenizer directory, a SentencePiece "
                f".model, or omit it for byte level")
    return None


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
