"""The .bin/.idx pair: exact round trip, and every kind of damage detected on open."""
import os
import struct

import numpy as np
import pytest

from megalite.data import CorruptIndexError, IndexedDataset, IndexedDatasetWriter


def _write(prefix, docs, vocab_size):
    writer = IndexedDatasetWriter(str(prefix), vocab_size, eod=vocab_size - 1)
    for doc in docs[:2]:
        writer.add_document(doc)
    if docs[2:]:
        writer.add_documents(np.array([len(d) for d in docs[2:]]), np.concatenate(docs[2:]))
    writer.finalize()


@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (100_000, np.int32)])
def test_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=n) for n in (5, 1, 17, 3, 40)]
    _write(tmp_path / "d", docs, vocab_size)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.dtype == dtype and len(ds) == 5 and ds.num_tokens == 66 and ds.vocab_size == vocab_size
    assert ds.doc_lengths.tolist() == [5, 1, 17, 3, 40]
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc.tolist()
    assert ds.get(2, offset=4, length=5).tolist() == docs[2][4:9].tolist()
    assert os.path.getsize(tmp_path / "d.bin") == 66 * np.dtype(dtype).itemsize
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # temporaries renamed away


def _damage_cases(tmp_path):
    """(description, function that damages a fresh pair, the file the error must name)."""
    def truncate(name, drop):
        def damage(prefix):
            path = prefix + name
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - drop)
        return damage, name

    def flip(offset, name=".idx"):
        def damage(prefix):
            with open(prefix + name, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x40]))
        return damage, name

    def short_idx(prefix):
        with open(prefix + ".idx", "r+b") as f:
            f.truncate(20)

    return {
        "truncated bin": truncate(".bin", 2),
        "truncated idx": truncate(".idx", 8),
        "idx shorter than header": (short_idx, ".idx"),
        "bad magic": flip(0),
        "bad version": flip(8),
        "flipped offset": flip(56 + 8 * 2),
    }


def test_corrupt_or_truncated_pair_detected(tmp_path):
    docs = [np.arange(n) % 257 for n in (5, 9, 4)]
    for description, (damage, name) in _damage_cases(tmp_path).items():
        prefix = str(tmp_path / description.replace(" ", "_"))
        _write(prefix, docs, 257)
        IndexedDataset(prefix)  # intact: opens
        damage(prefix)
        with pytest.raises(CorruptIndexError, match=os.path.basename(prefix) + name.replace(".", r"\.")):
            IndexedDataset(prefix)

    # a .bin from another dataset with a different size: not the matching pair
    _write(str(tmp_path / "a"), docs, 257)
    _write(str(tmp_path / "b"), docs[:2], 257)
    os.replace(tmp_path / "b.bin", tmp_path / "a.bin")
    with pytest.raises(CorruptIndexError, match="matching pair"):
        IndexedDataset(str(tmp_path / "a"))
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        IndexedDataset(str(tmp_path / "b"))  # its .bin is gone


def _write_megatron_pair(prefix, documents, dtype=np.uint16):
    """A Megatron-LM MMIDIDX pair written from its published layout: documents are lists of sentences."""
    sentences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    lengths = np.array([len(s) for s in sentences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    doc_starts = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype(np.int64)
    code = {np.uint16: 8, np.int32: 4}[dtype]
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sentences), len(doc_starts)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_starts.tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate(sentences).tobytes())


def test_reads_megatron_pairs(tmp_path):
    prefix = str(tmp_path / "mega")
    documents = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9], [10, 11, 12]]]  # a document = its sentences
    _write_megatron_pair(prefix, documents)
    ds = IndexedDataset(prefix)
    assert ds.format == "megatron" and ds.dtype == np.uint16 and ds.num_tokens == 12
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 4, 5], [6], [7, 8, 9, 10, 11, 12]]
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(CorruptIndexError, match=r"mega\.idx .*truncated"):
        IndexedDataset(prefix)
    _write_megatron_pair(prefix, documents)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CorruptIndexError, match=r"mega\.bin"):
        IndexedDataset(prefix)
