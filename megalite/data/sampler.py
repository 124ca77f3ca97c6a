"""Resumable global sampling: which global sample indices each dp rank reads at each step.

The position in the data is one number, `consumed_samples`, the same on every rank. Global
batch k covers consumed positions [consumed, consumed + G); dp rank r takes the contiguous
chunk [consumed + r*G/dp, consumed + (r+1)*G/dp) and cuts it into microbatches in order.
Position p maps to a sample index of the dataset: in the first epoch p itself (the dataset is
already shuffled by its seed), in epoch e >= 1 a seeded permutation of the dataset for that
epoch. So the sequence of samples a run sees depends only on (dataset, seed), and a run resumed
from a checkpoint's consumed_samples at another dp sees exactly the samples it would have seen.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


class GlobalBatchSampler:
    """Yields, per training step, this dp rank's microbatches: a list of lists of sample indices.

    `consumed_samples` advances by the step's global batch (store it in checkpoints): `global_batch_size`,
    or `batch_size_at(consumed_samples)` under a batch-size ramp-up (config/rampup.py: each of its
    batches divides by micro_batch_size * dp_size, checked before the run), so where a resumed run
    continues, and with which batch, follows from consumed_samples alone.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0, seed: int = 0, batch_size_at=None):
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size),
                            ("dp_size", dp_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..dp_size-1 = 0..{dp_size - 1}")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp="
                f"{micro_batch_size}*{dp_size}={micro_batch_size * dp_size}; choose a global batch size that is "
                f"a multiple of {micro_batch_size * dp_size} or change --micro-batch-size/--dp")
        if dataset_len < 1:
            raise ValueError(f"the dataset is empty (dataset_len={dataset_len}); use more data, a shorter "
                             f"--seq-length, or a larger share in --split")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset_len, self.global_batch_size, self.micro_batch_size = int(dataset_len), global_batch_size, \
            micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed_samples = int(consumed_samples)
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.batch_size_at = batch_size_at or (lambda consumed: self.global_batch_size)
        self.last_batch_size = global_batch_size  # the global batch of the step last yielded
        self._epoch_cache: tuple[int, np.ndarray | None] = (-1, None)

    def epoch_permutation(self, epoch: int) -> np.ndarray | None:
        """Order of the dataset in `epoch` (None = identity, used for epoch 0)."""
        if epoch == 0:
            return None
        if self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len))
        return self._epoch_cache[1]

    def sample_index(self, position: int) -> int:
        """Global position (number of samples consumed before it) -> dataset sample index."""
        epoch, offset = divmod(position, self.dataset_len)
        permutation = self.epoch_permutation(epoch)
        return offset if permutation is None else int(permutation[offset])

    def microbatches_at(self, consumed_samples: int, global_batch_size: int | None = None) -> list[list[int]]:
        """This rank's microbatches of the global batch (default `global_batch_size`) starting at
        `consumed_samples`."""
        per_rank = (global_batch_size or self.global_batch_size) // self.dp_size
        start = consumed_samples + self.dp_rank * per_rank
        indices = [self.sample_index(p) for p in range(start, start + per_rank)]
        mbs = self.micro_batch_size
        return [indices[i:i + mbs] for i in range(0, per_rank, mbs)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Endless: one item per step; advances consumed_samples as it goes."""
        while True:
            batch = self.batch_size_at(self.consumed_samples)
            if batch % (self.micro_batch_size * self.dp_size):
                raise ValueError(f"a global batch of {batch} samples does not split into microbatches of "
                                 f"{self.micro_batch_size} on {self.dp_size} dp ranks")
            microbatches = self.microbatches_at(self.consumed_samples, batch)
            self.consumed_samples += batch
            self.last_batch_size = batch
            yield microbatches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])


def eval_indices(dataset_len: int, num_samples: int, dp_rank: int, dp_size: int) -> list[int]:
    """This dp rank's share of the first `num_samples` validation samples (contiguous chunks).

    Deterministic and the same for every evaluation; `num_samples` is clipped to the dataset
    and must divide by dp_size so every rank evaluates the same number of samples.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..dp_size-1 = 0..{dp_size - 1}")
    num_samples = min(num_samples, dataset_len)
    if num_samples % dp_size:
        raise ValueError(f"eval samples {num_samples} (= min(requested, dataset_len={dataset_len})) is not "
                         f"divisible by dp={dp_size}; use --eval-iters * global_batch_size divisible by dp")
    per_rank = num_samples // dp_size
    return list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))


class EvalSampler:
    """Deterministic evaluation batches: `eval_iters` global batches from validation index 0.

    Iterating yields, per eval iteration, this rank's microbatches (lists of sample indices),
    exactly like GlobalBatchSampler but always starting at 0 and never shuffled between
    evaluations, so every evaluation of a run (and of any layout) scores the same samples.
    When the validation set is smaller than eval_iters global batches, the iterations that
    would run past its end are dropped (`len(sampler)` says how many remain).
    """

    def __init__(self, dataset_len: int, eval_iters: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self._batches = GlobalBatchSampler(max(dataset_len, 1), global_batch_size, micro_batch_size, dp_rank,
                                           dp_size)
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.eval_iters = min(eval_iters, dataset_len // global_batch_size)

    def __len__(self) -> int:
        return self.eval_iters

    def __iter__(self) -> Iterator[list[list[int]]]:
        for step in range(self.eval_iters):
            yield self._batches.microbatches_at(step * self.global_batch_size)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples: {"input_ids": [b, s], "labels": [b, s]} (LongTensors)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def load_microbatches(dataset, microbatches: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Read and collate one step's microbatches: [{"input_ids": [mbs, s], "labels": [mbs, s]}, ...]."""
    return [collate([dataset[i] for i in indices]) for indices in microbatches]
