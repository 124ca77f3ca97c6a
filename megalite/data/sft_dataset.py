"""SFT datasets: whole samples packed into sequences, position ids restarting per sample, the loss mask
as labels -100 (chosen by --sft; the samples come from tools/preprocess_data.py --sft).

A sample of n tokens (its eod included) gives n - 1 positions: inputs tokens[:-1], labels tokens[1:],
label i set to -100 where the mask of token i + 1 is 0 (a prompt token is not a target). A sequence of
seq_length positions holds whole samples one after the other (packing) or one (--no-sft-packing), then
padding (the eod id as input, labels -100). No sample ever straddles two sequences: samples are taken in
a seeded order and a sample that does not fit in the sequence being filled starts the next one
(next-fit; the order is the data order, the waste is reported by `fill`). A sample longer than the
sequence is refused naming it, or truncated to its first seq_length + 1 tokens (--sft-overlong).

Each item is {"input_ids", "labels", "position_ids"}: LongTensors [seq_length]. position_ids restart
at 0 at every sample (and at the padding), transformers' padding-free convention: a model that honours
them (document masks) sees each sample alone; the loss is the mean over the targets of the whole
global batch (labels != -100), so packing changes no sample's weight.
"""
from __future__ import annotations

import numpy as np
import torch

from megalite.data.gpt_dataset import SPLIT_NAMES, BlendedDataset, parse_data_path, parse_split, split_documents
from megalite.data.indexed_dataset import CorruptIndexError, DataError, IndexedDataset, dataset_exists
from megalite.data.sft_preprocess import mask_prefix

IGNORE = -100


def pack(positions: np.ndarray, seq_length: int, packing: bool) -> np.ndarray:
    """bounds int64[num_sequences + 1]: sequence j holds samples [bounds[j], bounds[j+1]) of `positions`
    (each sample's positions, in order, every one 1..seq_length). Next-fit: a sample that does not fit
    starts a new sequence; without packing every sample is a sequence."""
    if not packing:
        return np.arange(positions.size + 1, dtype=np.int64)
    bounds, used = [0], 0
    for i, n in enumerate(positions.tolist()):
        if used + n > seq_length:
            bounds.append(i)
            used = 0
        used += n
    if positions.size:
        bounds.append(positions.size)
    return np.asarray(bounds, dtype=np.int64)


class SFTDataset:
    """Sequences of whole samples from documents [doc_begin, doc_end) of a tokens pair and its mask pair."""

    def __init__(self, tokens: IndexedDataset, mask: IndexedDataset, doc_begin: int, doc_end: int, seq_length: int,
                 seed: int, *, packing: bool = True, truncate: bool = False, split: str = "train"):
        self.tokens, self.mask, self.doc_begin = tokens, mask, doc_begin
        self.seq_length, self.split, self.pad = seq_length, split, tokens.eod
        positions = tokens.doc_lengths[doc_begin:doc_end] - 1  # (input, label) pairs of each sample
        overlong = np.flatnonzero(positions > seq_length)
        if overlong.size and not truncate:
            first = int(overlong[0])
            raise DataError(f"{tokens.prefix}: sample {doc_begin + first} ({int(positions[first]) + 1} tokens) and "
                            f"{overlong.size - 1} more are longer than --seq-length {seq_length} + 1; raise "
                            f"--seq-length, or pass --sft-overlong truncate to cut them to fit")
        positions = np.minimum(positions, seq_length)
        rng = np.random.default_rng([seed, SPLIT_NAMES.index(split), 0x5F7])
        order = rng.permutation(positions.size)
        self.order = order[positions[order] > 0]  # a one-token sample has no target
        self.positions = positions  # per document of the range
        self.bounds = pack(positions[self.order], seq_length, packing)
        self.num_tokens = int(positions.sum())

    def __len__(self) -> int:
        return self.bounds.size - 1

    @property
    def fill(self) -> float:
        """The fraction of positions that hold sample tokens (1 - padding)."""
        return self.num_tokens / max(1, len(self) * self.seq_length)

    def samples(self, idx: int) -> list[int]:
        """The document indices (in the pair) of sequence `idx`, in order."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for the {self.split} split of {len(self)}")
        return [self.doc_begin + int(s) for s in self.order[self.bounds[idx]:self.bounds[idx + 1]]]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        s = self.seq_length
        ids, labels = np.full(s, self.pad, dtype=np.int64), np.full(s, IGNORE, dtype=np.int64)
        position_ids, cursor = np.zeros(s, dtype=np.int64), 0
        for doc in self.samples(int(idx)):
            n = int(self.positions[doc - self.doc_begin])
            tokens, mask = self.tokens.get(doc, 0, n + 1).astype(np.int64), self.mask.get(doc, 0, n + 1)
            ids[cursor:cursor + n] = tokens[:-1]
            labels[cursor:cursor + n] = np.where(mask[1:] != 0, tokens[1:], IGNORE)
            position_ids[cursor:cursor + n] = np.arange(n)
            cursor += n
        position_ids[cursor:] = np.arange(s - cursor)  # the padding: a document of its own
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(position_ids)}

    def __repr__(self) -> str:
        return (f"SFTDataset({self.tokens.prefix!r}, split={self.split}, samples={self.order.size}, "
                f"sequences={len(self)}, seq_length={self.seq_length}, fill={self.fill:.2f})")


def open_sft_pair(prefix: str) -> tuple[IndexedDataset, IndexedDataset]:
    """The tokens pair and its loss-mask pair, checked to describe the same documents."""
    if not dataset_exists(mask_prefix(prefix)):
        raise DataError(f"--sft --data-path {prefix}: no loss mask {mask_prefix(prefix)}.bin/.idx beside it; "
                        f"preprocess the records with tools/preprocess_data.py --sft")
    tokens, mask = IndexedDataset(prefix), IndexedDataset(mask_prefix(prefix))
    if not np.array_equal(tokens.offsets, mask.offsets):
        raise CorruptIndexError(f"{mask_prefix(prefix)} does not match {prefix} (other document lengths); "
                                f"preprocess both again with tools/preprocess_data.py --sft")
    return tokens, mask


def build_sft_datasets(data_path: list[str], split: str, seq_length: int, seed: int, tokenizer, *,
                       packing: bool = True, truncate: bool = False):
    """(train, valid, test) SFT datasets of --data-path's prefixes (blended by their weights); a split of
    weight 0 is None."""
    fractions, parts = parse_split(split), [[] for _ in SPLIT_NAMES]
    pairs = parse_data_path(data_path)
    for _, prefix in pairs:
        tokens, mask = open_sft_pair(prefix)
        if tokens.vocab_size > tokenizer.vocab_size:
            raise DataError(f"{prefix} was preprocessed with a vocabulary of {tokens.vocab_size} tokens but the "
                            f"tokenizer has {tokenizer.vocab_size}; pass the tokenizer it was preprocessed with")
        for s, (begin, end) in enumerate(split_documents(tokens.doc_lengths, fractions)):
            parts[s].append(SFTDataset(tokens, mask, begin, end, seq_length, seed, packing=packing,
                                       truncate=truncate, split=SPLIT_NAMES[s]))
    result = []
    for s, name in enumerate(SPLIT_NAMES):
        kept = [(w, ds) for (w, _), ds in zip(pairs, parts[s]) if len(ds) > 0]
        if fractions[s] == 0:
            result.append(None)
        elif name == "train" and not kept:
            raise DataError(f"the train split of {' '.join(p for _, p in pairs)} holds no SFT sample; change "
                            f"--split {split!r} or add records")
        elif len(kept) <= 1:
            result.append(kept[0][1] if kept else parts[s][0])
        else:
            result.append(BlendedDataset([ds for _, ds in kept], [w for w, _ in kept]))
    return tuple(result)
