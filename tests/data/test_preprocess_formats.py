"""tools/preprocess_data.py: Parquet input, and Megatron-LM's own .idx layout (MMIDIDX) as output."""
from __future__ import annotations

import importlib.util
import io
import json
import pathlib
import struct
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.preprocess import ProgressBar, preprocess_files

_spec = importlib.util.spec_from_file_location(
    "preprocess_data", pathlib.Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py")
preprocess_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_data)

TEXTS = ["the cat sat on the mat", "ünïcode documents too", "a third, longer document " * 5]


def _jsonl(path: pathlib.Path) -> str:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return str(path)


def _read_megatron_layout(prefix: str) -> tuple[np.dtype, list[np.ndarray]]:
    """The pair read by Megatron-LM's documented MMIDIDX layout (megatron/core/datasets/indexed_dataset.py),
    independently of megalite's reader: header, int32 sequence lengths, int64 byte pointers, int64 document
    indices; the .bin holds the sequences back to back."""
    raw = pathlib.Path(prefix + ".idx").read_bytes()
    magic, version, code, sequences, documents = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version) == (b"MMIDIDX\x00\x00", 1)
    dtype = np.dtype({1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}[code])
    offset = 34
    lengths = np.frombuffer(raw, np.int32, sequences, offset)
    pointers = np.frombuffer(raw, np.int64, sequences, offset + 4 * sequences)
    doc_index = np.frombuffer(raw, np.int64, documents, offset + 12 * sequences)
    assert len(raw) == offset + 12 * sequences + 8 * documents
    assert list(doc_index) == list(range(sequences + 1))  # one sequence per document
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    return dtype, [tokens[p // dtype.itemsize: p // dtype.itemsize + n] for p, n in zip(pointers, lengths)]


def test_megatron_index_round_trips(tmp_path):
    source = _jsonl(tmp_path / "docs.jsonl")
    preprocess_files([source], str(tmp_path / "ours"), "byte")
    preprocess_files([source], str(tmp_path / "theirs"), "byte", megatron_index=True)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()  # the tokens are shared
    dtype, documents = _read_megatron_layout(str(tmp_path / "theirs"))
    ours = IndexedDataset(str(tmp_path / "ours"))
    assert dtype == ours.dtype and len(documents) == len(TEXTS) == len(ours)
    for i, text in enumerate(TEXTS):
        assert list(documents[i][:-1]) == list(text.encode("utf-8"))  # byte tokens, then the end-of-document id
        assert np.array_equal(documents[i], ours[i])
    theirs = IndexedDataset(str(tmp_path / "theirs"))  # megalite trains on the Megatron pair too
    assert all(np.array_equal(theirs[i], ours[i]) for i in range(len(TEXTS)))


def test_parquet_reads_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), tmp_path / "docs.parquet",
                   row_group_size=2)
    assert preprocess_data.main(["--input", str(tmp_path / "docs.parquet"), "--output-prefix",
                                 str(tmp_path / "pq"), "--no-progress"]) == 0
    preprocess_files([_jsonl(tmp_path / "docs.jsonl")], str(tmp_path / "js"), "byte")
    assert (tmp_path / "pq_text_document.bin").read_bytes() == (tmp_path / "js.bin").read_bytes()
    assert (tmp_path / "pq_text_document.idx").read_bytes() == (tmp_path / "js.idx").read_bytes()
    assert preprocess_data.main(["--input", str(tmp_path / "docs.parquet"), "--json-keys", "body",
                                 "--output-prefix", str(tmp_path / "x"), "--no-progress"]) == 2


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "docs.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert preprocess_data.main(["--input", str(tmp_path / "docs.parquet"), "--output-prefix",
                                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "megalite[parquet]" in err[0]


def test_progress_lines_carry_rate_and_eta():
    stream = io.StringIO()  # not a terminal: plain lines
    bar = ProgressBar(total=4_000_000, stream=stream)
    bar.interval = 0.0
    bar.update(1_000_000, 10)
    bar.update(3_000_000, 30, final=True)
    first, last = stream.getvalue().splitlines()
    assert "25.0%" in first and "MB/s" in first and " eta " in first
    assert "100.0%" in last and "40 docs" in last and "eta" not in last
