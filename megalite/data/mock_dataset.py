"""Synthetic token ids (`--mock-data`): a model with a real vocabulary trains without a corpus.

Sample i of a split is `seq_length + 1` ids drawn uniformly from [0, vocab_size) by a generator
seeded with (seed, split, i) alone, so the same (seed, data position) gives the same tokens on every
rank, every layout and every resume; the samples have the shape and dtype of GPTDataset's. The ids
carry no structure to learn (the loss stays near ln(vocab_size)): this data is for measuring speed,
memory and the plumbing of a real-vocabulary model, not for learning anything.
"""
from __future__ import annotations

import numpy as np
import torch

from megalite.data.gpt_dataset import SPLIT_NAMES, parse_split
from megalite.data.indexed_dataset import DataError

# Samples per split: more than any run consumes (2^40 samples of even 128 tokens is 1.4e14 tokens), so
# the sampler stays in its first epoch, where position p reads sample p and nothing is permuted.
MOCK_SAMPLES = 2 ** 40


class MockDataset:
    """`num_samples` samples of `seq_length` tokens, each a pure function of (seed, split, index)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, split: str = "train",
                 num_samples: int = MOCK_SAMPLES):
        if vocab_size < 1 or seq_length < 1:
            raise ValueError(f"MockDataset needs vocab_size >= 1 and seq_length >= 1, got {vocab_size}, {seq_length}")
        self.vocab_size, self.seq_length, self.seed, self.split = vocab_size, seq_length, seed, split
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `idx` (int64)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample index {idx} out of range for the mock {self.split} split of "
                             f"{self.num_samples} samples")
        rng = np.random.default_rng([self.seed, SPLIT_NAMES.index(self.split), idx])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self.tokens(int(idx)))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}

    def __repr__(self) -> str:
        return (f"MockDataset(split={self.split}, vocab_size={self.vocab_size}, seq_length={self.seq_length}, "
                f"seed={self.seed})")


def build_mock_datasets(vocab_size: int, seq_length: int, seed: int = 0, split: str = "969,30,1"):
    """(train, valid, test) like build_gpt_datasets: a split of weight 0 is None, the others endless."""
    fractions = parse_split(split)
    if fractions[0] == 0:
        raise DataError(f"--split {split!r} gives the training split weight 0; give it a positive weight")
    return tuple(MockDataset(vocab_size, seq_length, seed, name) if fraction > 0 else None
                 for name, fraction in zip(SPLIT_NAMES, fractions))
