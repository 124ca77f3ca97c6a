"""GPT datasets: fixed-length samples addressed by a global sample index, splits and blending.

`build_gpt_datasets` is the entry point: Megatron-style `--data-path` (one prefix, or
weight/prefix pairs), `--split 969,30,1`, and the stdlib default corpus when no path is given.

A sample is a dict of two LongTensors of `seq_length` tokens: `input_ids` and `labels`,
with `labels[i]` the token following `input_ids[i]` (already shifted); with document fields
(data/documents.py) also `position_ids` restarting per document, and/or masked targets. Sample i depends only
on the data, the split, seq_length and the seed, never on the parallel layout, so every rank
that asks for index i gets the same tokens.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch

from megalite.data.default_corpus import build_default_corpus
from megalite.data.documents import DocumentFields
from megalite.data.indexed_dataset import DataError, IndexedDataset
from megalite.data.sample_index import cached_sample_index
from megalite.data.tokenizer import load_tokenizer

SPLIT_NAMES = ("train", "valid", "test")


class GPTDataset:
    """Samples of `seq_length + 1` tokens from documents [doc_begin, doc_end) of an IndexedDataset."""

    def __init__(self, indexed: IndexedDataset, doc_begin: int, doc_end: int, seq_length: int, seed: int,
                 split: str = "train", cache_dir: str | None = None, documents: DocumentFields | None = None):
        self.indexed, self.doc_begin, self.doc_end = indexed, doc_begin, doc_end
        self.documents = documents  # position ids / loss mask from the index's end-of-document token
        self.seq_length, self.seed, self.split = seq_length, seed, split
        lengths = indexed.doc_lengths[doc_begin:doc_end]
        identity = f"{indexed.fingerprint()}|{doc_begin}:{doc_end}"
        self.index = cached_sample_index(lengths, seq_length, seed, SPLIT_NAMES.index(split), identity, cache_dir)
        self.num_tokens = int(lengths.sum())

    def __len__(self) -> int:
        return len(self.index)

    def tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `idx` (int64)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample index {idx} out of range for the {self.split} split of "
                             f"{len(self)} samples")
        stream_sample = int(self.index.shuffle[idx])
        position, offset = int(self.index.sample_doc[stream_sample]), int(self.index.sample_offset[stream_sample])
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < out.size:  # walk consecutive documents of the stream until the sample is full
            doc = self.doc_begin + int(self.index.doc_order[position])
            piece = self.indexed.get(doc, offset, out.size - filled)
            out[filled:filled + piece.size] = piece
            filled += piece.size
            position, offset = position + 1, 0
        return out

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self.tokens(int(idx)))
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        return self.documents.apply(sample, self.indexed.eod) if self.documents is not None else sample

    def __repr__(self) -> str:
        return (f"GPTDataset({self.indexed.prefix!r}, split={self.split}, docs={self.doc_end - self.doc_begin}, "
                f"tokens={self.num_tokens}, samples={len(self)}, seq_length={self.seq_length})")


def blend_assignment(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Interleave datasets by weight: (dataset id, k-th sample of that dataset) for `size` slots.

    Dataset d's k-th sample is placed at time (k + 1/2) / w_d and all placements are merged in
    time order (ties by dataset id). So after any n slots dataset d has been used w_d * n
    times to within one sample, and over the whole blend floor or ceil of w_d * size times.
    Vectorised: O(size log size).
    """
    times, ids, ranks = [], [], []
    for d, w in enumerate(weights):
        count = int(np.ceil(w * size)) + 1
        k = np.arange(count, dtype=np.int64)
        times.append((k + 0.5) / w)
        ids.append(np.full(count, d, dtype=np.int64))
        ranks.append(k)
    times, ids, ranks = map(np.concatenate, (times, ids, ranks))
    order = np.lexsort((ids, times))[:size]
    return ids[order], ranks[order]


class BlendedDataset:
    """Datasets mixed by normalised weights with exact proportions (see `blend_assignment`).

    Length: the sum of the parts' lengths, so one pass over the blend is as long as one pass
    over the parts; a part whose weight asks for more samples than it has wraps around.
    """

    def __init__(self, datasets: list, weights: list[float]):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        for d, (ds, w) in enumerate(zip(datasets, weights)):
            if len(ds) == 0:
                raise DataError(f"blended dataset {d} ({ds!r}) has no samples but weight {w}; "
                                 f"drop it from --data-path or give it more data")
        total = float(sum(weights))
        self.datasets, self.weights = datasets, [w / total for w in weights]
        self.size = sum(len(ds) for ds in datasets)
        self.dataset_index, self.dataset_sample = blend_assignment(self.weights, self.size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample index {idx} out of range for a blend of {self.size} samples")
        ds = self.datasets[int(self.dataset_index[idx])]
        return ds[int(self.dataset_sample[idx]) % len(ds)]


def parse_data_path(data_path: list[str] | str | None) -> list[tuple[float, str]]:
    """['prefix'] or ['w1', 'p1', 'w2', 'p2', ...] -> [(weight, prefix)] (weights not normalised).

    A single string is split on whitespace ("0.7 a 0.3 b").
    """
    if not data_path:
        return []
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise DataError(f"--data-path {' '.join(items)}: give one prefix, or weight/prefix pairs like "
                         f"'--data-path 0.7 a 0.3 b'")
    pairs = []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise DataError(f"--data-path: {weight!r} should be a weight (a number) before prefix "
                             f"{prefix!r}; use '--data-path 0.7 a 0.3 b'") from None
        if not 0 < value < math.inf:  # (NaN fails both)
            raise DataError(f"--data-path: weight {weight} of {prefix!r} must be a finite positive number, like "
                             f"'--data-path 0.7 a 0.3 b'")
        pairs.append((value, prefix))
    return pairs


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '0.9,0.1', missing parts 0) -> three fractions summing to 1."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise DataError(f"--split {split!r}: expected up to three numbers like '969,30,1'") from None
    if not 1 <= len(parts) <= 3 or not all(0 <= p < math.inf for p in parts) or sum(parts) <= 0:  # NaN: refused
        raise DataError(f"--split {split!r}: expected up to three finite non-negative numbers with a positive "
                         f"sum, like '969,30,1'")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_documents(doc_lengths: np.ndarray, fractions: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges, one per split, holding about `fractions` of the tokens each.

    A document belongs to the split whose token range contains its midpoint; a zero-weight
    split is always empty and the last non-empty split always ends at the last document.
    """
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    ends = np.cumsum(doc_lengths)
    midpoints = ends - doc_lengths / 2
    total = int(ends[-1]) if len(ends) else 0
    bounds = [0] + [int(np.searchsorted(midpoints, c * total, side="left")) for c in np.cumsum(fractions)]
    last_nonzero = max(i for i, f in enumerate(fractions) if f > 0)
    for i, fraction in enumerate(fractions):
        if i == last_nonzero:
            bounds[i + 1] = len(doc_lengths)
        elif fraction == 0:
            bounds[i + 1] = bounds[i]
    return list(zip(bounds[:-1], bounds[1:]))


def build_gpt_datasets(data_path: list[str] | None, split: str = "969,30,1", seq_length: int | None = None,
                       seed: int = 0, tokenizer=None, cache_dir: str | None = None,
                       documents: DocumentFields | None = None):
    """Return (train, valid, test) datasets; a split with weight 0 is None.

    data_path: None/[] for the stdlib default corpus, [prefix], or [w1, prefix1, w2, prefix2, ...]
        (prefixes of .bin/.idx pairs written by tools/preprocess_data.py; weights need not sum to 1).
    split: relative sizes of train/valid/test by tokens, at document granularity.
    tokenizer: the tokenizer object (or a spec for `load_tokenizer`); the data must have been
        preprocessed with a tokenizer of at most its vocab size.
    cache_dir: where the default corpus and sample indices are cached (default $MEGALITE_CACHE
        or ~/.cache/megalite). Safe to call from many ranks at once.
    documents: what each sample gains from its end-of-document tokens (data/documents.py), or None.
    """
    if seq_length is None or int(seq_length) < 1:
        raise ValueError(f"build_gpt_datasets needs seq_length >= 1, got {seq_length!r}")
    seq_length = int(seq_length)
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    fractions = parse_split(split)
    pairs = parse_data_path(data_path)
    if not pairs:
        pairs = [(1.0, build_default_corpus(tokenizer, cache_dir))]
    per_split: list[list] = [[] for _ in SPLIT_NAMES]
    for _, prefix in pairs:
        indexed = IndexedDataset(prefix)
        if indexed.vocab_size > tokenizer.vocab_size:
            raise DataError(f"{prefix} was preprocessed with a vocabulary of {indexed.vocab_size} tokens but "
                             f"the tokenizer has {tokenizer.vocab_size}; pass the tokenizer used by "
                             f"tools/preprocess_data.py (--tokenizer)")
        ranges = split_documents(indexed.doc_lengths, fractions)
        for s, (name, (begin, end)) in enumerate(zip(SPLIT_NAMES, ranges)):
            per_split[s].append(GPTDataset(indexed, begin, end, seq_length, seed, name, cache_dir, documents)
                                if fractions[s] > 0 else None)
    result = []
    for s, name in enumerate(SPLIT_NAMES):
        parts = per_split[s]
        if fractions[s] == 0:
            result.append(None)
            continue
        empty = [ds for ds in parts if len(ds) == 0]
        if empty:
            message = (f"the {name} split of {empty[0].indexed.prefix} has {empty[0].num_tokens} tokens, fewer "
                       f"than seq_length+1 = {seq_length + 1}, so it holds no sample; change --split "
                       f"{split!r} or use more data")
            if name == "train":
                raise DataError(message)
            if int(os.environ.get("RANK", "0")) == 0:  # every rank builds the same splits: one notice, not one per rank
                warnings.warn(message)
            parts = [ds for ds in parts if len(ds) > 0]
            weights = [w for (w, _), ds in zip(pairs, per_split[s]) if len(ds) > 0]
        else:
            weights = [w for w, _ in pairs]
        if not parts:
            result.append(per_split[s][0])  # an empty dataset: len 0
        elif len(parts) == 1:
            result.append(parts[0])
        else:
            result.append(BlendedDataset(parts, weights))
    return tuple(result)
