"""GPT samples against a brute-force reference, splits, blending with exact proportions."""
import numpy as np
import pytest
import torch

from data_helpers import random_texts, write_byte_dataset
from megalite.data import (BlendedDataset, ByteTokenizer, GPTDataset, IndexedDataset, blend_assignment,
                           build_gpt_datasets, parse_data_path, parse_split, split_documents)
from megalite.data.sample_index import build_sample_index

SEQ = 16


def test_samples_match_brute_force_stream(tmp_path):
    docs = write_byte_dataset(str(tmp_path / "d"), random_texts(40, seed=0, max_len=60))
    indexed = IndexedDataset(str(tmp_path / "d"))
    ds = GPTDataset(indexed, 3, 37, SEQ, seed=7, split="train", cache_dir=str(tmp_path / "cache"))
    # reference: the split's documents in the seeded order, concatenated, cut every SEQ tokens
    order = np.random.default_rng([7, 0, 0]).permutation(34)
    stream = np.concatenate([docs[3 + d] for d in order])
    assert ds.num_tokens == stream.size and len(ds) == (stream.size - 1) // SEQ
    windows = [stream[j * SEQ:j * SEQ + SEQ + 1] for j in range(len(ds))]
    seen = []
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (SEQ,)
        tokens = torch.cat([sample["input_ids"], sample["labels"][-1:]])
        assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])  # labels already shifted
        j = int(ds.index.shuffle[i])
        assert tokens.tolist() == windows[j].tolist()
        seen.append(j)
    assert sorted(seen) == list(range(len(ds)))  # a permutation: every window exactly once
    assert seen != sorted(seen)

    again = GPTDataset(indexed, 3, 37, SEQ, seed=7, split="train", cache_dir=str(tmp_path / "cache"))  # cached
    other_seed = GPTDataset(indexed, 3, 37, SEQ, seed=8, split="train", cache_dir=str(tmp_path / "cache"))
    assert all(torch.equal(again[i]["input_ids"], ds[i]["input_ids"]) for i in range(len(ds)))
    assert not all(torch.equal(other_seed[i]["input_ids"], ds[i]["input_ids"]) for i in range(len(ds)))
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_sample_index_edge_cases():
    index = build_sample_index(np.array([3, 0, 5, 1]), seq_length=2, seed=0)  # an empty document inside
    assert len(index) == (9 - 1) // 2
    assert len(build_sample_index(np.array([2, 1]), seq_length=3, seed=0)) == 0  # < seq+1 tokens
    with pytest.raises(ValueError, match="seq_length"):
        build_sample_index(np.array([4]), seq_length=0, seed=0)


def test_split_parsing_and_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("9,1") == pytest.approx([0.9, 0.1, 0.0])
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    lengths = np.full(100, 10)
    assert split_documents(lengths, [0.8, 0.2, 0.0]) == [(0, 80), (80, 100), (100, 100)]
    assert split_documents(lengths, [0.5, 0.0, 0.5]) == [(0, 50), (50, 50), (50, 100)]
    assert split_documents(np.array([90, 5, 5]), [0.9, 0.05, 0.05]) == [(0, 1), (1, 2), (2, 3)]
    assert parse_data_path(["p"]) == [(1.0, "p")]
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    for bad in (["1", "a", "2"], ["x", "a"], ["0", "a"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.98, 0.01], [1 / 3, 1 / 3, 1 / 3]])
def test_blend_assignment_exact_proportions(weights):
    size = 10_000
    ids, ranks = blend_assignment(weights, size)
    counts = np.stack([np.cumsum(ids == d) for d in range(len(weights))], axis=1)  # [size, datasets]
    ideal = np.arange(1, size + 1)[:, None] * np.array(weights)[None, :]
    assert np.abs(counts - ideal).max() <= 1.0  # every prefix within one sample of its share
    whole = np.array(weights) * size  # the whole blend: each part gets floor or ceil of its share
    assert np.all((counts[-1] == np.floor(whole + 1e-9)) | (counts[-1] == np.ceil(whole - 1e-9)))
    for d in range(len(weights)):
        assert ranks[ids == d].tolist() == list(range(int(counts[-1, d])))  # each part read in order


def test_build_gpt_datasets_blended_and_validated(tmp_path):
    write_byte_dataset(str(tmp_path / "a"), random_texts(60, seed=1))
    write_byte_dataset(str(tmp_path / "b"), random_texts(20, seed=2))
    kwargs = dict(seq_length=SEQ, seed=3, tokenizer=ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    a_train, a_valid, a_test = build_gpt_datasets([str(tmp_path / "a")], "8,2,0", **kwargs)
    b_train, _, _ = build_gpt_datasets([str(tmp_path / "b")], "8,2,0", **kwargs)
    assert a_test is None and len(a_valid) > 0
    train, valid, _ = build_gpt_datasets(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], "8,2,0",
                                         **kwargs)
    assert isinstance(train, BlendedDataset) and len(train) == len(a_train) + len(b_train)
    counts = np.bincount(train.dataset_index, minlength=2)
    assert np.all(np.abs(counts - np.array([0.7, 0.3]) * len(train)) < 1)
    parts = [a_train, b_train]
    for i in range(0, len(train), 7):  # a blended sample is exactly the part's sample
        d, k = int(train.dataset_index[i]), int(train.dataset_sample[i])
        assert torch.equal(train[i]["input_ids"], parts[d][k % len(parts[d])]["input_ids"])

    with pytest.raises(ValueError, match="seq_length"):
        build_gpt_datasets([str(tmp_path / "a")], "8,2,0", seq_length=None)
    with pytest.raises(ValueError, match="fewer than seq_length"):
        build_gpt_datasets([str(tmp_path / "b")], "1,0,0", seq_length=100_000, tokenizer="byte",
                           cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="valid split"):
        build_gpt_datasets([str(tmp_path / "b")], "999,1,0", seq_length=SEQ, tokenizer="byte",
                           cache_dir=str(tmp_path / "cache"))

    class SmallVocab(ByteTokenizer):
        vocab_size = 100

    with pytest.raises(ValueError, match="--tokenizer"):
        build_gpt_datasets([str(tmp_path / "a")], **{**kwargs, "tokenizer": SmallVocab()})


def test_bad_data_paths_are_usage_errors_named_with_their_fix(tmp_path):
    """At dataset build time (before training): one line naming the file and the fix."""
    from megalite.data import DataFileNotFoundError
    from megalite.data.indexed_dataset import CorruptIndexError
    from megalite.errors import UsageError

    write_byte_dataset(str(tmp_path / "good"), random_texts(30, seed=1))
    write_byte_dataset(str(tmp_path / "small"), random_texts(3, seed=2))
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "swapped.bin").write_bytes((tmp_path / "small.bin").read_bytes())  # another pair's .bin
    (tmp_path / "swapped.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    (tmp_path / "truncated.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    (tmp_path / "truncated.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:-6])
    (tmp_path / "text.idx").write_bytes(b"this is not an index file at all, just text " * 4)
    (tmp_path / "text.bin").write_bytes(b"abc")

    class SmallVocab(ByteTokenizer):
        vocab_size = 100

    cases = [
        ("missing", DataFileNotFoundError, ["missing.idx does not exist", "tools/preprocess_data.py"]),
        ("good.bin", DataFileNotFoundError, ["give the prefix of the pair, without .bin", str(tmp_path / "good")]),
        ("corpus.jsonl", DataFileNotFoundError, ["is a raw file", "--input", str(tmp_path / "corpus.jsonl")]),
        (".", DataFileNotFoundError, ["is a directory", "preprocess it"]),
        ("truncated", CorruptIndexError, ["truncated.bin", "truncated or not the matching pair"]),
        ("swapped", CorruptIndexError, ["swapped.bin", "not the matching pair", "re-run tools/preprocess_data.py"]),
        ("text", CorruptIndexError, ["text.idx is not a megalite index", "re-run tools/preprocess_data.py"]),
    ]
    for path, error, needles in cases:
        with pytest.raises(error) as caught:
            build_gpt_datasets([str(tmp_path / path)], "1,0,0", seq_length=SEQ, tokenizer="byte",
                               cache_dir=str(tmp_path / "cache"))
        message = str(caught.value)
        assert isinstance(caught.value, UsageError) and "\n" not in message, (path, message)
        assert all(needle in message for needle in needles), (path, message)
    with pytest.raises(UsageError, match=r"preprocessed with a vocabulary of 257 tokens .* \(--tokenizer\)"):
        build_gpt_datasets([str(tmp_path / "good")], "1,0,0", seq_length=SEQ, tokenizer=SmallVocab(),
                           cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="weight/prefix pairs"):
        build_gpt_datasets(["0.5", str(tmp_path / "good"), "0.5"], seq_length=SEQ, tokenizer="byte")
