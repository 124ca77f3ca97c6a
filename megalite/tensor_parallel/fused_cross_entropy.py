"""The output layer and the vocab-parallel cross entropy in one op that never holds the logits.

Unfused, the last stage keeps the logits shard [tokens, V/tp] from forward to backward and
backward adds its gradient, the same size: at 8192 tokens and Llama-3's 128256 columns that
is 2 x 2.1 GB in bf16 at tp=1, often the largest single allocation of a run. Here the tokens
go through in chunks of `chunk_tokens`:

    forward:  per chunk  logits_c = h_c @ W^T  -> this rank's (max, sum-exp, target logit)
              slots of the stats buffer [tokens, 2*tp + 1]; logits_c is dropped.
              ONE all-reduce of the stats over tp (as unfused), then lse and losses.
    backward: per chunk  logits_c again, dlogits_c = (softmax - onehot) * dloss,
              dh_c = dlogits_c @ W,  dW += dlogits_c^T @ h_c   (into the DP engine's fp32
              main grad chunk by chunk; else an fp32 accumulator)
              then dh's tp reduction: all-reduce, or reduce-scatter to the sequence shard.

Kept for backward: h (the sequence shard under SP, re-gathered in backward like
`sequence_parallel_linear`), lse and targets. The price is one more GEMM of the output
layer's forward size in backward (the logits are recomputed), and the peak transient is one
chunk's logits and gradient instead of the whole shard's. Same function as
`linear` + `vocab_parallel_cross_entropy` (tests: losses, dh and dW at tp = 1, 2, 4, with and
without SP, against the unfused path and the tp=1 model).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params
from megalite.kernels.cross_entropy import check_target_range, merge_stats, new_stats, shard_grad, shard_stats
from megalite.kernels.dispatch import use_triton
from megalite.tensor_parallel.layers import resolve_tp_group
from megalite.parameters.weight_grad import route_weight_grads
from megalite.parameters.weight_grad import bypasses_autograd, deliver

DEFAULT_CHUNK_BYTES = 256 << 20  # one chunk's logits: bounds the transient, big enough for full-speed GEMMs


def default_chunk_tokens(vocab_shard: int, element_size: int) -> int:
    """Tokens per chunk so that one chunk's logits take about DEFAULT_CHUNK_BYTES."""
    return max(1, DEFAULT_CHUNK_BYTES // max(1, vocab_shard * element_size))


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, sequence_parallel, vocab_size, ignore_index, chunk_tokens):
        # hidden [s(/tp), b, h]; weight [V_pad/tp, h]; targets [s, b] global ids
        tp = comm.group_size(group)
        gather = sequence_parallel and tp > 1
        full = comm.all_gather(hidden, group, dim=0) if gather else hidden  # [s, b, h]
        rows = full.reshape(-1, full.shape[-1])  # [tokens, h]
        flat_targets = targets.reshape(-1).contiguous()
        shard_cols = weight.shape[0]
        vocab_start = comm.group_rank(group) * shard_cols
        n_valid = max(0, min(shard_cols, vocab_size - vocab_start))  # this shard's columns inside the vocab
        use_kernels = use_triton(weight)
        stats = new_stats(rows.shape[0], group, rows.device)
        for start in range(0, rows.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # [c, V/tp]
            shard_stats(logits, flat_targets[start:end], stats[start:end], n_valid, vocab_start, ignore_index,
                        group, use_kernels)
        comm.all_reduce(stats, group)  # the only forward communication
        lse, losses = merge_stats(stats, flat_targets, ignore_index)
        ctx.save_for_backward(hidden, weight, flat_targets, lse)
        ctx.parameter = weight  # itself: where its gradient goes (bypasses_autograd)
        ctx.meta = (group, gather, vocab_start, n_valid, ignore_index, chunk_tokens, use_kernels)
        return losses.view(targets.shape)

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, flat_targets, lse = ctx.saved_tensors
        group, gather, vocab_start, n_valid, ignore_index, chunk_tokens, use_kernels = ctx.meta
        full = comm.all_gather(hidden, group, dim=0) if gather else hidden  # re-gathered: [s, b, h]
        rows = full.reshape(-1, full.shape[-1])
        dloss = dloss.reshape(-1).contiguous()
        grad_rows = torch.empty_like(rows)  # [tokens, h], this shard's partial contribution
        # With a gradient sink (the DP engine's fp32 main grad) each chunk's dW goes straight in;
        # otherwise (plain autograd, or a deferred weight pass) an fp32 accumulator [V/tp, h].
        to_sink = bypasses_autograd(ctx.parameter) and params.deferred(ctx.parameter) is None
        grad_weight = None if to_sink else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, rows.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, rows.shape[0])
            logits = rows[start:end] @ weight.t()  # recomputed: [c, V/tp]
            dlogits = shard_grad(logits, flat_targets[start:end], lse[start:end], dloss[start:end], n_valid,
                                 vocab_start, ignore_index, use_kernels)
            del logits
            grad_rows[start:end] = dlogits @ weight
            chunk_grad_weight = dlogits.t() @ rows[start:end]  # [V/tp, h]
            if to_sink:
                deliver(ctx.parameter, chunk_grad_weight)
            else:
                grad_weight += chunk_grad_weight.float()
        grad_hidden = grad_rows.view(full.shape)  # the input was replicated (or gathered) across tp:
        if gather:                                 # sum the shards' partials, back to [s/tp, b, h]
            grad_hidden = comm.reduce_scatter(grad_hidden, group, dim=0)
        elif comm.group_size(group) > 1:
            comm.all_reduce(grad_hidden, group)
        if to_sink:
            return grad_hidden, None, None, None, None, None, None, None
        grad_weight = grad_weight.to(weight.dtype)
        if bypasses_autograd(ctx.parameter):  # deferred: the weight pass delivers the finished gradient
            route_weight_grads(ctx.parameter, None, lambda: (grad_weight, None))
            return grad_hidden, None, None, None, None, None, None, None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                        tp_group=None, *, sequence_parallel: bool = False,
                                        vocab_size: int | None = None, ignore_index: int = -100,
                                        chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-token losses [s, b] (fp32, 0 at ignored targets) of the output layer and the
    vocab-parallel cross entropy, fused (see the module docstring).

    hidden: [s, b, h], or the sequence shard [s/tp, b, h] with sequence_parallel (gathered
      inside, as Megatron's output layer does); replicated across tp otherwise.
    weight: this rank's vocabulary rows [V_pad/tp, h] (rank r holds rows r*V_pad/tp ...).
    targets: [s, b] global token ids or ignore_index; vocab_size: the true vocabulary (columns
      past it are padding); chunk_tokens: tokens per chunk (default: ~256 MB of logits).
    Equal to vocab_parallel_cross_entropy(copy_to_tp(hidden) @ weight.T, targets, ...).
    """
    group = resolve_tp_group(tp_group)
    tp = comm.group_size(group)
    seq = hidden.shape[0] * (tp if sequence_parallel else 1)
    if hidden.dim() != 3 or targets.shape != (seq, hidden.shape[1]):
        raise ValueError(f"hidden {tuple(hidden.shape)} (sequence_parallel={sequence_parallel}, tp={tp}) and "
                         f"targets {tuple(targets.shape)} do not fit hidden [s(/tp), b, h], targets [s, b]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [V/tp, {hidden.shape[-1]}]")
    total = vocab_size if vocab_size is not None else tp * weight.shape[0]
    if total > tp * weight.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp} shards of {weight.shape[0]} rows")
    check_target_range(targets, total, ignore_index)  # no host read: a device-side assert on a GPU
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], weight.element_size())
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _LinearCrossEntropyFunction.apply(hidden, weight, targets, group, bool(sequence_parallel), int(total),
                                             int(ignore_index), int(chunk_tokens))
