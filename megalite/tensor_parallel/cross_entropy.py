"""Cross entropy over vocabulary-sharded logits, never gathering the full logits.

Each tp rank holds logits for the columns [start, start + V/tp). Two all-reduces over the tp
group, each of one value (or two) per token:
  1. the per-token max (for a stable softmax);
  2. the target logit (from the rank that owns the target column) and the sum of exp.
loss = log(sum_exp) - (target_logit - max). Backward needs no communication: the gradient on
this shard is softmax - onehot, scaled by the incoming per-token gradient.

Columns at or past `vocab_size` (vocabulary padding) are excluded from the softmax, so the loss
is the unpadded model's loss whatever the padding (which depends on tp).
"""
from __future__ import annotations

import torch

from megalite import comm
from megalite.tensor_parallel.layers import resolve_tp_group

try:  # the fused Triton form (one packed all-reduce), used where the kernel backend picks Triton
    from megalite import kernels as _kernels
    from megalite.kernels.dispatch import use_triton as _use_triton
except ImportError:  # pragma: no cover
    _kernels = None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index, vocab_size):
        # logits: [..., V/tp] (any dtype; math in fp32); targets: [...] global column ids.
        local_vocab = logits.shape[-1]
        start = comm.group_rank(group) * local_vocab
        x = logits.float()  # a copy for low-precision inputs; cloned below for fp32 so logits stay intact
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        if vocab_size is not None and start + local_vocab > vocab_size:
            x[..., max(0, vocab_size - start):] = float("-inf")

        token_max = x.max(dim=-1).values  # [...]
        comm.all_reduce(token_max, group, op="max")
        x.sub_(token_max.unsqueeze(-1))

        valid = targets != ignore_index
        local_target = targets - start
        owned = valid & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.clamp(0, local_vocab - 1)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [...]
        target_logit = torch.where(owned, target_logit, torch.zeros_like(target_logit))  # not `* owned`: -inf * 0

        x.exp_()
        partials = torch.stack([target_logit, x.sum(dim=-1)])  # [2, ...]: one all-reduce for both
        comm.all_reduce(partials, group)
        target_logit, sum_exp = partials[0], partials[1]

        loss = torch.where(valid, torch.log(sum_exp) - target_logit, torch.zeros_like(sum_exp))
        x.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward: [..., V/tp] fp32
        ctx.save_for_backward(x, local_target, owned, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, owned, valid = ctx.saved_tensors
        grad = softmax  # reuse the buffer: backward runs once
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


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
    if _kernels is not None and _use_triton(logits_shard):
        start = comm.group_rank(group) * logits_shard.shape[-1]
        return _kernels.vocab_parallel_cross_entropy(logits_shard, targets, start, group, ignore_index, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, group, ignore_index, vocab_size)
