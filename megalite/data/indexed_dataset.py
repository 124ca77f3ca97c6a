"""Memory-mapped indexed dataset: a `.bin` of token ids plus an `.idx` of document offsets.

On-disk format (little endian), written by `IndexedDatasetWriter`, read by `IndexedDataset`:

    prefix.bin   token ids, one flat array of `dtype` (uint16 when the vocab fits, else int32)
    prefix.idx   header (56 bytes)                 then offsets: int64[num_docs + 1]
                   magic      8s  b"MLITEIDX"        offsets[0] = 0, offsets[-1] = num_tokens,
                   version    u32 (1)                document d = tokens[offsets[d]:offsets[d+1]]
                   dtype code u32 (see DTYPES)       (its last token is the end-of-document id)
                   vocab_size i64
                   eod        i64
                   num_docs   u64
                   num_tokens u64
                   crc32      u32 of the offsets bytes
                   reserved   u32

Opening checks the magic, version, dtype, both file sizes, the offsets' CRC and that offsets
are non-decreasing, so a corrupt or truncated pair fails at once with an error naming the
file, never later as garbage samples. Files are written under temporary names and renamed
into place, so a crashed writer leaves no half pair behind.

`IndexedDataset` also reads Megatron-LM's `MMIDIDX` pairs (checked the same way, except that
they carry no CRC and no vocabulary size), so corpora preprocessed for Megatron train as they are.
"""
from __future__ import annotations

import array
import functools
import glob
import os
import struct
import zlib

import numpy as np

from megalite.errors import UsageError

MAGIC = b"MLITEIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIqqQQII")  # 56 bytes, keeps the offsets 8-byte aligned
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 3: np.dtype(np.int32), 4: np.dtype(np.int64)}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


class DataError(UsageError, ValueError):
    """A data input the user must fix (a path, its files, the tokenizer or split that goes with them)."""


class CorruptIndexError(DataError):
    """The .bin/.idx pair is unreadable, truncated, of another format, or not a matching pair."""


class DataFileNotFoundError(UsageError, FileNotFoundError):
    """A data path whose .bin or .idx does not exist (the message says what the path looks like instead)."""


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def token_dtype_for(vocab_size: int) -> np.dtype:
    """Smallest dtype holding ids 0..vocab_size-1 (halves disk and page cache vs int32)."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def megatron_prefix(output_prefix: str, json_key: str) -> str:
    """Megatron-LM's name for one JSON key's pair: PREFIX_{key}_document (.bin/.idx)."""
    return f"{output_prefix}_{json_key}_document"


def resolve_prefix(prefix: str) -> str:
    """The pair a --data-path PREFIX names: PREFIX.bin/.idx when they exist, else the one Megatron-named
    PREFIX_{key}_document pair beside it (what tools/preprocess_data.py writes); DataError when there
    are several to choose from. Unchanged when neither exists (the reader then says what is missing)."""
    if dataset_exists(prefix):
        return prefix
    found = sorted(path[:-len(".idx")] for path in glob.glob(glob.escape(prefix) + "_*_document.idx"))
    found = [candidate for candidate in found if dataset_exists(candidate)]
    if len(found) > 1:
        raise DataError(f"data path {prefix}: several preprocessed keys beside it ({', '.join(found)}); pass one "
                        f"of them as the prefix")
    return found[0] if found else prefix


class IndexedDatasetWriter:
    """Appends documents (arrays of token ids) and writes the .bin/.idx pair on `finalize()`.

    Writes go to `prefix.bin.tmp-<pid>` / `prefix.idx.tmp-<pid>`; `finalize` renames them.
    """

    def __init__(self, prefix: str, vocab_size: int, eod: int, dtype: np.dtype | None = None,
                 megatron_index: bool = False):
        self.prefix, self.megatron_index = prefix, megatron_index  # the .idx in Megatron-LM's MMIDIDX layout
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype_for(vocab_size)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"token dtype {self.dtype} unsupported; use one of {sorted(map(str, DTYPE_CODES))}")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = data_file_path(prefix) + suffix
        self._idx_tmp = index_file_path(prefix) + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = array.array("q")  # 8 bytes per document, whatever the corpus size
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (the caller includes the end-of-document id)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a document must be a 1-D array of ids, got shape {tokens.shape}")
        self.add_documents(np.array([tokens.size]), tokens)

    def add_documents(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Append many documents at once: `tokens` is their concatenation, `lengths` their sizes."""
        lengths, tokens = np.asarray(lengths, dtype=np.int64), np.asarray(tokens)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, vocab_size={self.vocab_size}), got "
                             f"[{int(tokens.min())}, {int(tokens.max())}]; is this the right tokenizer?")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.frombytes(lengths.tobytes())
        self.num_tokens += tokens.size

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if self._lengths else np.zeros(0, np.int64)
        if self.megatron_index:
            write_megatron_index(self._idx_tmp, lengths, self.dtype)
        else:
            write_index(self._idx_tmp, lengths, self.dtype, self.vocab_size, self.eod)
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, index_file_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)


def write_index(path: str, doc_lengths: np.ndarray, dtype: np.dtype, vocab_size: int, eod: int) -> None:
    """Write an .idx file for documents of `doc_lengths` tokens (used by the writer and tools)."""
    offsets = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=offsets[1:])
    offset_bytes = offsets.tobytes()
    header = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[np.dtype(dtype)], int(vocab_size), int(eod),
                         len(doc_lengths), int(offsets[-1]), zlib.crc32(offset_bytes), 0)
    with open(path, "wb") as f:
        f.write(header)
        f.write(offset_bytes)


class IndexedDataset:
    """Read-only view of a .bin/.idx pair; documents are numpy views into a memory map."""

    def __init__(self, prefix: str):
        prefix = resolve_prefix(prefix)  # PREFIX, or Megatron's PREFIX_text_document
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataFileNotFoundError(_missing_pair_message(prefix, path))
        with open(idx_path, "rb") as f:
            is_megatron = f.read(len(MEGATRON_MAGIC)) == MEGATRON_MAGIC
        read = _read_megatron_index if is_megatron else _read_megalite_index
        self.dtype, self.vocab_size, self.eod, self.offsets, self.crc = read(idx_path)
        self.format = "megatron" if is_megatron else "megalite"
        num_tokens = int(self.offsets[-1])
        bin_size, expected_bin = os.path.getsize(bin_path), num_tokens * self.dtype.itemsize
        if bin_size != expected_bin:
            raise CorruptIndexError(f"{bin_path} is {bin_size} bytes but {idx_path} describes {num_tokens} "
                                    f"tokens of {self.dtype} ({expected_bin} bytes): truncated or not the "
                                    f"matching pair; re-run tools/preprocess_data.py")
        self.num_tokens = num_tokens
        if self.num_tokens:
            self.tokens = np.asarray(np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,)))
        else:  # numpy cannot map an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.offsets) - 1

    @functools.cached_property
    def doc_lengths(self) -> np.ndarray:
        """int64[num_docs]: tokens per document (end-of-document token included)."""
        return np.diff(self.offsets)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of document `doc` from `offset`, at most `length` of them (a memory-map view)."""
        start, end = int(self.offsets[doc]) + offset, int(self.offsets[doc + 1])
        if length is not None:
            end = min(end, start + length)
        return self.tokens[start:end]

    def __getitem__(self, doc: int) -> np.ndarray:
        return self.get(doc)

    def fingerprint(self) -> str:
        """Content identity for cache keys: changes whenever the documents change."""
        return f"{self.crc:08x}-{len(self)}-{self.num_tokens}-{self.dtype.str}"

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype}, vocab_size={self.vocab_size})")


def _missing_pair_message(prefix: str, missing: str) -> str:
    """Why `prefix` names no .bin/.idx pair, and the fix (the common mistakes first)."""
    stem, ext = os.path.splitext(prefix)
    if ext in (".bin", ".idx") and dataset_exists(stem):
        return f"data path {prefix}: give the prefix of the pair, without {ext}: {stem}"
    if os.path.isdir(prefix):
        return (f"data path {prefix} is a directory, not the prefix of a .bin/.idx pair; preprocess it with "
                f"tools/preprocess_data.py --input {prefix} --output-prefix PREFIX and pass PREFIX")
    if os.path.isfile(prefix):
        return (f"data path {prefix} is a raw file, not the prefix of a .bin/.idx pair; preprocess it with "
                f"tools/preprocess_data.py --input {prefix} --output-prefix {stem} and pass {stem}")
    return f"{missing} does not exist; create the pair with tools/preprocess_data.py --output-prefix {prefix}"


def _read_megalite_index(idx_path: str):
    """-> (dtype, vocab_size, eod, offsets int64[num_docs + 1], crc) after checking everything."""
    idx_size = os.path.getsize(idx_path)
    if idx_size < HEADER.size:
        raise CorruptIndexError(f"{idx_path} is truncated: {idx_size} bytes, shorter than the "
                                f"{HEADER.size}-byte header; re-run tools/preprocess_data.py")
    with open(idx_path, "rb") as f:
        fields = HEADER.unpack(f.read(HEADER.size))
    magic, version, dtype_code, vocab_size, eod, num_docs, num_tokens, crc, _ = fields
    if magic != MAGIC:
        raise CorruptIndexError(f"{idx_path} is not a megalite index (magic {magic!r}, expected "
                                f"{MAGIC!r}); re-run tools/preprocess_data.py")
    if version != VERSION:
        raise CorruptIndexError(f"{idx_path} has format version {version}, this megalite reads "
                                f"version {VERSION}; re-run tools/preprocess_data.py")
    if dtype_code not in DTYPES:
        raise CorruptIndexError(f"{idx_path} has unknown dtype code {dtype_code}; the file is corrupt")
    expected_idx = HEADER.size + 8 * (num_docs + 1)
    if idx_size != expected_idx:
        raise CorruptIndexError(f"{idx_path} is {idx_size} bytes but its header promises {num_docs} "
                                f"documents ({expected_idx} bytes): truncated or corrupt; re-run "
                                f"tools/preprocess_data.py")
    # np.asarray: a plain ndarray view of the map (np.memmap adds overhead to every index)
    offsets = np.asarray(np.memmap(idx_path, dtype=np.int64, mode="r", offset=HEADER.size, shape=(num_docs + 1,)))
    if zlib.crc32(memoryview(offsets)) != crc:
        raise CorruptIndexError(f"{idx_path}: document offsets fail their CRC check (corrupt file); "
                                f"re-run tools/preprocess_data.py")
    if offsets[0] != 0 or offsets[-1] != num_tokens or bool(np.any(np.diff(offsets) < 0)):
        raise CorruptIndexError(f"{idx_path}: document offsets are inconsistent with the header")
    return DTYPES[dtype_code], int(vocab_size), int(eod), offsets, int(crc)


# Megatron-LM's "MMIDIDX" index, read so existing Megatron-preprocessed corpora train as they
# are: magic (9 bytes), version u64 = 1, dtype code u8, sequence count u64, document count u64,
# then int32 sequence lengths, int64 sequence byte pointers, int64 document start indices (into
# the sequences, num_docs + 1 of them) and, for multimodal data, int8 sequence modes.
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def write_megatron_index(path: str, doc_lengths: np.ndarray, dtype: np.dtype) -> None:
    """An .idx in Megatron-LM's MMIDIDX layout, each document one sequence (what its preprocess_data.py
    writes without sentence splitting): header (magic, version 1, dtype code, sequence count, document
    count + 1), then int32 sequence lengths, int64 byte pointers into the .bin, int64 document starts."""
    codes = {np.dtype(d): code for code, d in MEGATRON_DTYPES.items()}
    dtype = np.dtype(dtype)
    if dtype not in codes:
        raise ValueError(f"token dtype {dtype} has no Megatron code; use one of {sorted(map(str, codes))}")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
        raise ValueError("a document longer than 2**31 - 1 tokens does not fit Megatron's int32 sequence lengths")
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MEGATRON_HEADER.pack(MEGATRON_MAGIC, 1, codes[dtype], lengths.size, lengths.size + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(lengths.size + 1, dtype=np.int64).tobytes())


def _read_megatron_index(idx_path: str):
    """-> (dtype, vocab_size 0 = unknown, eod -1 = unknown, document offsets, crc of the offsets)."""
    idx_size = os.path.getsize(idx_path)
    if idx_size < MEGATRON_HEADER.size:
        raise CorruptIndexError(f"{idx_path} is truncated: {idx_size} bytes, shorter than Megatron's "
                                f"{MEGATRON_HEADER.size}-byte header")
    with open(idx_path, "rb") as f:
        _, version, dtype_code, num_sequences, num_doc_starts = MEGATRON_HEADER.unpack(f.read(MEGATRON_HEADER.size))
    if version != 1 or dtype_code not in MEGATRON_DTYPES or num_doc_starts < 1:
        raise CorruptIndexError(f"{idx_path}: unsupported or corrupt Megatron index (version {version}, dtype code "
                                f"{dtype_code}, {num_doc_starts} document starts)")
    arrays_size = 12 * num_sequences + 8 * num_doc_starts
    if idx_size not in (MEGATRON_HEADER.size + arrays_size, MEGATRON_HEADER.size + arrays_size + num_sequences):
        raise CorruptIndexError(f"{idx_path} is {idx_size} bytes but its header promises {num_sequences} sequences "
                                f"and {num_doc_starts - 1} documents: truncated or corrupt")
    dtype = np.dtype(MEGATRON_DTYPES[dtype_code])
    base = MEGATRON_HEADER.size
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype=np.int32, count=num_sequences, offset=base).astype(np.int64)
    pointers = np.frombuffer(raw, dtype=np.int64, count=num_sequences, offset=base + 4 * num_sequences)
    doc_starts = np.frombuffer(raw, dtype=np.int64, count=num_doc_starts, offset=base + 12 * num_sequences)
    sequence_offsets = np.zeros(num_sequences + 1, dtype=np.int64)
    np.cumsum(lengths, out=sequence_offsets[1:])
    if (np.any(lengths < 0) or not np.array_equal(pointers, sequence_offsets[:-1] * dtype.itemsize)
            or doc_starts[0] != 0 or doc_starts[-1] != num_sequences or bool(np.any(np.diff(doc_starts) < 0))):
        raise CorruptIndexError(f"{idx_path}: Megatron sequence lengths, pointers and document starts disagree "
                                f"(corrupt, or sequences not stored back to back)")
    offsets = sequence_offsets[doc_starts]  # a document spans its sentences' tokens
    return dtype, 0, -1, offsets, zlib.crc32(memoryview(offsets))
