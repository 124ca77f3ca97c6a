"""Text -> tokens -> .bin/.idx: the one preprocessing path (CLI and default corpus both use it).

Inputs are plain-text files (one file = one document), directories (walked in sorted order,
every file one document, or JSON lines for .jsonl/.json files), JSON-lines files (one
document per line per `json_keys` entry) and Parquet files (one document per row per `json_keys`
column; pyarrow, the [parquet] extra). Every document gets the tokenizer's end-of-document
id appended; empty documents and files that are not UTF-8 are skipped and counted.

Tokenisation runs in `workers` forked processes on batches of about 1 MB of text while the
parent reads and parses the input and writes the arrays; at most 4 batches per worker are in
flight (bounded memory), and results are written in input order, so the output is
byte-identical for any number of workers. With the byte tokenizer the parent's reading is the
bottleneck and one worker is fastest; workers are for real (BPE) tokenizers.
"""
from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from megalite.data.indexed_dataset import (DataError, DataFileNotFoundError, IndexedDatasetWriter, megatron_prefix,
                                           token_dtype_for)
from megalite.data.tokenizer import load_tokenizer
from megalite.extras import require
from megalite.progress import ProgressBar

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
BATCH_BYTES = 1 << 20  # text per worker task: large enough to amortise pickling


@dataclass
class PreprocessStats:
    documents: int = 0
    skipped_empty: int = 0
    skipped_not_utf8: int = 0
    text_bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)  # json key -> output prefix

    def summary(self) -> str:
        mb = self.text_bytes / 1e6
        rate = self.seconds and mb / self.seconds
        token_rate = self.seconds and self.tokens / self.seconds
        return (f"{self.documents} documents, {mb:.1f} MB of text -> {self.tokens} tokens in "
                f"{self.seconds:.2f} s ({rate:.1f} MB/s, {token_rate:,.0f} tokens/s); skipped "
                f"{self.skipped_empty} empty, {self.skipped_not_utf8} not UTF-8")


def list_input_files(inputs: Iterable[str]) -> list[str]:
    """Expand directories (recursively, sorted, hidden entries skipped); keep the given order."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in names if not n.startswith(".")]
            files += sorted(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise DataFileNotFoundError(f"--input {path!r} is neither a file nor a directory")
    return files


def iter_documents(files: list[str], json_keys: tuple[str, ...], stats: PreprocessStats
                   ) -> Iterator[tuple[str, str, int]]:
    """Yield (json key, text, bytes read) in input order."""
    for path in files:
        if path.endswith(JSON_SUFFIXES):
            yield from _json_documents(path, json_keys)
        elif path.endswith(PARQUET_SUFFIXES):
            yield from _parquet_documents(path, json_keys)
        else:
            if len(json_keys) > 1:
                raise ValueError(f"{path} is plain text but several --json-keys were given; "
                                 f"plain-text files only go with a single key")
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skipped_not_utf8 += 1
                continue
            yield json_keys[0], text, len(raw)


def _batches(documents: Iterator[tuple[str, str, int]], stats: PreprocessStats):
    """Group documents into ~BATCH_BYTES batches: (keys, texts, bytes)."""
    keys, texts, size = [], [], 0
    for key, text, nbytes in documents:
        if not text:
            stats.skipped_empty += 1
            continue
        keys.append(key)
        texts.append(text)
        size += nbytes
        if size >= BATCH_BYTES:
            yield keys, texts, size
            keys, texts, size = [], [], 0
    if texts:
        yield keys, texts, size


_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, set once at fork
    _worker_tokenizer = tokenizer
    # the processes are the parallelism: stop each HF tokenizer from also starting a thread per core
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_batch(batch, tokenizer=None):
    """(keys, texts, bytes) -> (keys, lengths int64[n], tokens with eod after each document, bytes).

    Tokens come back in the on-disk dtype (uint16 for vocabularies up to 65536), which keeps
    the pickled result that crosses back from a worker 4x smaller than int64.
    """
    tokenizer = tokenizer or _worker_tokenizer
    keys, texts, nbytes = batch
    dtype = token_dtype_for(tokenizer.vocab_size)
    if hasattr(tokenizer, "encode_batch_arrays"):
        encoded = tokenizer.encode_batch_arrays(texts)
    else:
        encode = getattr(tokenizer, "encode_array", None) or (lambda t: np.asarray(tokenizer.encode(t)))
        encoded = [encode(text) for text in texts]
    eod = np.array([tokenizer.eod], dtype=dtype)
    pieces, lengths = [], np.empty(len(texts), dtype=np.int64)
    for i, ids in enumerate(encoded):
        pieces += [ids, eod]
        lengths[i] = ids.size + 1
    return keys, lengths, np.concatenate(pieces, dtype=dtype, casting="unsafe"), nbytes


def _json_documents(path: str, json_keys: tuple[str, ...]) -> Iterator[tuple[str, str, int]]:
    """(key, text, bytes) of each JSON line's keys; DataError naming the line of a malformed one."""
    with open(path, "rb") as f:  # each line decoded alone: a decoder reading ahead would name a later line
        for line_number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{line_number}: not UTF-8 text (byte {exc.start + 1} of the line); "
                                f"JSON-lines input is UTF-8, one object per line") from None
            if not line.strip():
                continue
            for key, text in _json_record(path, line_number, line, json_keys):
                yield key, text, len(line)


def _parquet_file(path: str):
    """pyarrow's ParquetFile of `path` (pyarrow is the [parquet] extra); DataError for a file it cannot read."""
    parquet = require("pyarrow.parquet", f"--input {path}")
    try:
        return parquet.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid/OSError for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())})") from None


def _parquet_documents(path: str, json_keys: tuple[str, ...]) -> Iterator[tuple[str, str, int]]:
    """(key, text, UTF-8 bytes) of each row's --json-keys columns, row groups read one batch at a time."""
    table = _parquet_file(path)
    columns = table.schema_arrow.names
    missing = [key for key in json_keys if key not in columns]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {columns}); pick the text's column with "
                        f"--json-keys")
    row = 0
    for batch in table.iter_batches(batch_size=1024, columns=list(json_keys)):
        values = {key: batch.column(key).to_pylist() for key in json_keys}
        for i in range(batch.num_rows):
            row += 1
            for key in json_keys:
                text = values[key][i]
                if text is not None and not isinstance(text, str):
                    raise DataError(f"{path}: row {row}, column {key!r} is a {type(text).__name__}, not a string; "
                                    f"pick the text's column with --json-keys")
                yield key, text or "", len((text or "").encode("utf-8"))


def _input_bytes(path: str, json_keys: tuple[str, ...]) -> int:
    """What the progress bar counts to: the file's size, a Parquet file's uncompressed text columns."""
    if not path.endswith(PARQUET_SUFFIXES):
        return os.path.getsize(path)
    meta, names = _parquet_file(path).metadata, set(json_keys)
    return sum(meta.row_group(g).column(c).total_uncompressed_size for g in range(meta.num_row_groups)
               for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema in names)


def json_object(path: str, line_number: int, line: str, *, shape: str) -> dict:
    """The JSON object on line `line_number` of `path` (JSON-lines input: pretraining text, SFT records);
    a DataError naming the line when it is no JSON, or JSON but no object. shape: what an object holds,
    for the message (e.g. '{"text": "..."}')."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{line_number}: not valid JSON ({exc}); JSON-lines input needs one object per "
                        f"line, e.g. {shape}") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line_number}: a JSON {type(record).__name__}, not an object; JSON-lines input "
                        f"needs one object per line, e.g. {shape}")
    return record


def _json_record(path: str, line_number: int, line: str, json_keys: tuple[str, ...]) -> list[tuple[str, str]]:
    record = json_object(path, line_number, line, shape='{"text": "..."}')
    texts = []
    for key in json_keys:
        if key not in record:
            raise DataError(f"{path}:{line_number}: no key {key!r} (keys: {sorted(record)}); pick one with "
                            f"--json-keys")
        if not isinstance(record[key], str):
            raise DataError(f"{path}:{line_number}: {key!r} is a {type(record[key]).__name__}, not a string; "
                            f"fix the line or pick the text's key with --json-keys")
        texts.append((key, record[key]))
    return texts


def preprocess_documents(documents: Iterable[tuple[str, str, int]], output_prefix: str, tokenizer,
                         json_keys: tuple[str, ...] = ("text",), workers: int = 1,
                         progress: ProgressBar | None = None,
                         stats: PreprocessStats | None = None, megatron_index: bool = False,
                         megatron_names: bool = False) -> PreprocessStats:
    """Tokenize (key, text, bytes) documents into one .bin/.idx pair per key.

    Output prefix: `output_prefix` for a single key, `{output_prefix}_{key}` for several; with
    `megatron_names` Megatron-LM's `{output_prefix}_{key}_document` for every key (what the tool writes).
    `tokenizer` is a tokenizer object or a spec for `load_tokenizer`.
    """
    if isinstance(tokenizer, str) or tokenizer is None:
        tokenizer = load_tokenizer(tokenizer)
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    stats = stats or PreprocessStats()
    start = time.perf_counter()
    if megatron_names:  # Megatron-LM's names, one pair per key
        prefixes = {key: megatron_prefix(output_prefix, key) for key in json_keys}
    else:
        prefixes = {key: output_prefix if len(json_keys) == 1 else f"{output_prefix}_{key}" for key in json_keys}
    writers = {key: IndexedDatasetWriter(prefix, tokenizer.vocab_size, tokenizer.eod, megatron_index=megatron_index)
               for key, prefix in prefixes.items()}
    pool = None
    try:
        batches = _batches(iter(documents), stats)
        if workers == 1:
            results = (_encode_batch(batch, tokenizer) for batch in batches)
        else:
            pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
            results = _ordered_bounded_map(pool, batches, max_pending=4 * workers)
        for keys, lengths, tokens, nbytes in results:
            _write_batch(writers, keys, lengths, tokens)
            stats.documents += len(keys)
            stats.tokens += tokens.size
            stats.text_bytes += nbytes
            if progress:
                progress.update(nbytes, len(keys))
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if progress:
        progress.update(0, 0, final=True)
    stats.seconds = time.perf_counter() - start
    stats.outputs = prefixes
    return stats


def _ordered_bounded_map(pool, batches, max_pending: int):
    """Like pool.imap, but reads ahead at most `max_pending` batches (imap would pull the whole
    corpus into memory) and yields results in input order (output independent of workers)."""
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch, (batch,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write_batch(writers, keys, lengths, tokens) -> None:
    if len(writers) == 1:
        next(iter(writers.values())).add_documents(lengths, tokens)
        return
    ends = np.cumsum(lengths)
    for i, key in enumerate(keys):  # several keys interleave: route document by document
        writers[key].add_document(tokens[ends[i] - lengths[i]:ends[i]])


def preprocess_files(inputs: Iterable[str], output_prefix: str, tokenizer=None,
                     json_keys: tuple[str, ...] = ("text",), workers: int = 1,
                     show_progress: bool = False, megatron_index: bool = False,
                     megatron_names: bool = False) -> PreprocessStats:
    """Files/directories/JSON lines/Parquet -> .bin/.idx (what tools/preprocess_data.py runs);
    `megatron_index`: the .idx in Megatron-LM's MMIDIDX layout (both frameworks read the pair);
    `megatron_names`: PREFIX_{key}_document per key, as Megatron-LM names them."""
    inputs = list(inputs)
    files = list_input_files(inputs)
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no input files found (an empty directory, or only hidden "
                        f"files); give text or JSON-lines files")
    stats = PreprocessStats()
    progress = ProgressBar(sum(_input_bytes(f, tuple(json_keys)) for f in files)) if show_progress else None
    return preprocess_documents(iter_documents(files, tuple(json_keys), stats), output_prefix, tokenizer,
                                tuple(json_keys), workers, progress, stats, megatron_index, megatron_names)
