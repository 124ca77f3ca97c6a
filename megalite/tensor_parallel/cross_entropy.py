"""Cross entropy over vocabulary-sharded logits, never gathering the full logits.

Each tp rank holds logits for the columns [start, start + V/tp). One all-reduce over the tp
group of a [tokens, 2*tp + 1] fp32 buffer carries every rank's per-token max and sum-exp (each
rank writes its own slots) and the target logit (from the rank that owns the target column);
each rank then merges the partials with log-sum-exp. Backward needs no communication: the
gradient on this shard is softmax - onehot, scaled by the incoming per-token gradient.

Columns at or past `vocab_size` (vocabulary padding) are excluded from the softmax, so the loss
is the unpadded model's loss whatever the padding (which depends on tp). The implementation
lives in `megalite.kernels.cross_entropy`: the Triton kernels where the kernel backend picks
them (CUDA), the same algorithm in PyTorch elsewhere.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.kernels import vocab_parallel_cross_entropy as _sharded_cross_entropy
from megalite.tensor_parallel.layers import resolve_tp_group


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, tp_group=None,
                                 ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy losses [...] (0 at ignored targets) from vocab-sharded logits.

    logits_shard: [..., V_pad/tp], this rank's contiguous slice of the vocabulary columns.
    targets: [...], global token ids (or `ignore_index`).
    vocab_size: the true vocabulary size; columns at or past it are padding and ignored.
    """
    group = resolve_tp_group(tp_group)
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits_shard.shape)}")
    start = comm.group_rank(group) * logits_shard.shape[-1]
    return _sharded_cross_entropy(logits_shard, targets, start, group, ignore_index, vocab_size)
