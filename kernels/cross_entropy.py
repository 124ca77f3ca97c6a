"""Cross entropy over the vocabulary with an online softmax; single-device and vocab-parallel.

Per token (row) the forward kernel streams the logits in chunks of BLOCK_V columns, keeping a
running max m and a running sum of exp(x - m) (Milakov & Gimelshein 2018), and picks out the
target's logit. Nothing vocab-sized is kept in fp32: the statistics are three floats per
token, and backward recomputes softmax chunk by chunk from the saved log-sum-exp:

    loss = logsumexp(x) - x[target]            (0 where target == ignore_index)
    dx   = (softmax(x) - onehot(target)) * dloss

Vocab-parallel (Megatron's VocabParallel CE, one all-reduce instead of three): rank r holds
columns [start, start + V/tp) of the padded vocabulary. Each rank writes into one fp32 buffer
[tokens, 2*tp + 1], zero elsewhere, its local max into slot r, its local sum-exp (relative
to that max) into slot tp + r, and, if it owns the target column, the target logit into
slot 2*tp. One all_reduce(sum) then gives every rank all partials, and each merges them:

    M = max_r m_r;  S = sum_r s_r * exp(m_r - M);  lse = M + log S;  loss = lse - x[target]

Columns at or beyond `vocab_size` (padding added so the vocabulary divides by tp) are left
out of the softmax and get zero gradient. Backward is local: softmax - onehot on the shard.
Both backends (Triton kernels, torch reference statistics) share that one all-reduce.
Losses are returned in float32.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm

from .dispatch import as_rows, check_float_dtype, check_same_device, new_output, next_power_of_2, runnable, tl, \
    triton, use_triton

MAX_BLOCK_V = {"cuda": 4096, "cpu": 512}  # small chunks in the interpreter exercise the chunk loop
NEG_BIG = -1.0e30  # finite "minus infinity" for running maxima: exp(NEG_BIG - NEG_BIG) stays finite


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    vocab = logits.shape[-1]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1),
                                               ignore_index=ignore_index, reduction="none")
    return losses.view(targets.shape)


@triton.jit
def _softmax_stats_kernel(LOGITS, TARGETS, STATS, row_stride, stats_row_stride, n_valid, vocab_start,
                          ignore_index, max_slot, sumexp_slot, target_slot, BLOCK_V: tl.constexpr):
    """Per row: max and sum-exp over the row's first n_valid columns, and the owned target logit."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * row_stride
    cols = tl.arange(0, BLOCK_V)
    running_max = -1.0e30
    running_sum = 0.0
    # Whole blocks load unmasked (16-byte vector loads); only the tail block, when n_valid is
    # not a multiple of BLOCK_V (GPT-2's 50257), pays for a mask. A mask on an odd bound would
    # make every load in the row scalar.
    full_end = (n_valid // BLOCK_V) * BLOCK_V
    for start in range(0, full_end, BLOCK_V):
        x = tl.load(row_ptr + start + cols).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    for start in range(full_end, n_valid, BLOCK_V):  # at most one iteration
        x = tl.load(row_ptr + start + cols, mask=start + cols < n_valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    target = tl.load(TARGETS + row).to(tl.int64)
    local = target - vocab_start
    owns = (target != ignore_index) & (local >= 0) & (local < n_valid)
    target_logit = tl.load(row_ptr + tl.where(owns, local, 0), mask=owns, other=0.0).to(tl.float32)
    stats_ptr = STATS + row * stats_row_stride
    tl.store(stats_ptr + max_slot, running_max)
    tl.store(stats_ptr + sumexp_slot, running_sum)
    tl.store(stats_ptr + target_slot, tl.where(owns, target_logit, 0.0))


@triton.jit
def _softmax_grad_kernel(LOGITS, TARGETS, LSE, DLOSS, DLOGITS, row_stride, n_cols, n_valid, vocab_start,
                         ignore_index, BLOCK_V: tl.constexpr):
    """Per row: dlogits = (exp(x - lse) - onehot) * dloss on valid columns, 0 on padding columns."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row).to(tl.int64)
    scale = tl.where(target != ignore_index, tl.load(DLOSS + row).to(tl.float32), 0.0)
    local = target - vocab_start
    lse = tl.load(LSE + row)
    cols = tl.arange(0, BLOCK_V)
    row_in = LOGITS + row * row_stride
    row_out = DLOGITS + row * n_cols
    full_end = (n_valid // BLOCK_V) * BLOCK_V  # unmasked whole blocks, as in the stats kernel
    for start in range(0, full_end, BLOCK_V):
        idx = start + cols
        x = tl.load(row_in + idx).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(idx == local, 1.0, 0.0)) * scale
        tl.store(row_out + idx, grad.to(DLOGITS.dtype.element_ty))
    for start in range(full_end, n_cols, BLOCK_V):  # the valid tail, then padding columns (gradient 0)
        idx = start + cols
        x = tl.load(row_in + idx, mask=idx < n_valid, other=float("-inf")).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(idx == local, 1.0, 0.0)) * scale
        grad = tl.where(idx < n_valid, grad, 0.0)
        tl.store(row_out + idx, grad.to(DLOGITS.dtype.element_ty), mask=idx < n_cols)


def _block_v(n_cols: int, device: torch.device) -> int:
    return min(next_power_of_2(max(n_cols, 1)), MAX_BLOCK_V["cuda" if device.type == "cuda" else "cpu"])


def _stats_triton(rows, targets, stats, n_valid, vocab_start, ignore_index, tp_rank, tp):
    block = _block_v(n_valid, rows.device)
    runnable(_softmax_stats_kernel, rows.device)[(rows.shape[0],)](
        rows, targets, stats, rows.stride(0), stats.stride(0), n_valid, vocab_start, ignore_index,
        tp_rank, tp + tp_rank, 2 * tp, BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


def _stats_torch(rows, targets, stats, n_valid, vocab_start, ignore_index, tp_rank, tp):
    x = rows[:, :n_valid].float()  # reference path: may materialise the fp32 shard
    if n_valid > 0:
        row_max = x.max(dim=1).values
        stats[:, tp_rank] = row_max
        stats[:, tp + tp_rank] = torch.exp(x - row_max[:, None]).sum(dim=1)
        local = targets - vocab_start
        owns = (targets != ignore_index) & (local >= 0) & (local < n_valid)
        picked = x.gather(1, local.clamp(0, n_valid - 1)[:, None])[:, 0]
        stats[:, 2 * tp] = torch.where(owns, picked, torch.zeros_like(picked))
    else:
        stats[:, tp_rank] = NEG_BIG


def _grad_triton(rows, targets, lse, dloss, n_valid, vocab_start, ignore_index):
    n_rows, n_cols = rows.shape
    dlogits = new_output((n_rows, n_cols), rows.dtype, rows.device)
    block = _block_v(n_cols, rows.device)
    runnable(_softmax_grad_kernel, rows.device)[(n_rows,)](
        rows, targets, lse, dloss, dlogits, rows.stride(0), n_cols, n_valid, vocab_start, ignore_index,
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
    return dlogits


def _grad_torch(rows, targets, lse, dloss, n_valid, vocab_start, ignore_index):
    grad = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    grad[:, :n_valid] = torch.exp(rows[:, :n_valid].float() - lse[:, None])
    local = targets - vocab_start
    owns = (targets != ignore_index) & (local >= 0) & (local < n_valid)
    # minus one at each owned target, without nonzero() (a host sync): -0.0 elsewhere changes nothing
    if n_valid > 0:
        grad.scatter_add_(1, local.clamp(0, n_valid - 1)[:, None], -owns.float()[:, None])
    scale = torch.where(targets != ignore_index, dloss.float(), torch.zeros_like(dloss, dtype=torch.float32))
    return (grad * scale[:, None]).to(rows.dtype)


def new_stats(tokens: int, tp_group, device: torch.device) -> torch.Tensor:
    """The zeroed fp32 buffer [tokens, 2*tp + 1]: maxima (tp slots), sum-exps (tp slots), target logit."""
    return torch.zeros(tokens, 2 * comm.group_size(tp_group) + 1, dtype=torch.float32, device=device)


def shard_stats(rows: torch.Tensor, targets: torch.Tensor, stats: torch.Tensor, n_valid: int, vocab_start: int,
                ignore_index: int, tp_group, use_kernels: bool) -> None:
    """Write this rank's slots of `stats` for logits rows [tokens, V/tp] (no communication)."""
    compute = _stats_triton if use_kernels else _stats_torch
    compute(rows, targets, stats, n_valid, vocab_start, ignore_index, comm.group_rank(tp_group),
            comm.group_size(tp_group))


def merge_stats(stats: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' partials (after the all-reduce) -> (lse [tokens], losses [tokens]), fp32."""
    tp = (stats.shape[1] - 1) // 2
    maxima, sumexps, target_logit = stats[:, :tp], stats[:, tp:2 * tp], stats[:, 2 * tp]
    global_max = maxima.max(dim=1).values
    lse = global_max + torch.log((sumexps * torch.exp(maxima - global_max[:, None])).sum(dim=1))
    return lse, torch.where(targets != ignore_index, lse - target_logit, torch.zeros_like(lse))


def shard_grad(rows: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor, n_valid: int,
               vocab_start: int, ignore_index: int, use_kernels: bool) -> torch.Tensor:
    """d loss / d rows [tokens, V/tp] in the rows' dtype: (softmax - onehot) * dloss, 0 on padding."""
    compute = _grad_triton if use_kernels else _grad_torch
    return compute(rows, targets, lse, dloss, n_valid, vocab_start, ignore_index)


class _ShardedCrossEntropyFunction(torch.autograd.Function):
    """Per-token CE of logits split by columns over tp_group (tp_group=None: one device)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, n_valid, tp_group, ignore_index, use_kernels):
        rows = as_rows(logits)  # [..., V/tp] -> [tokens, V/tp]
        flat_targets = targets.reshape(-1).contiguous()
        stats = new_stats(rows.shape[0], tp_group, rows.device)
        shard_stats(rows, flat_targets, stats, n_valid, vocab_start, ignore_index, tp_group, use_kernels)
        comm.all_reduce(stats, tp_group)  # the only communication, forward and backward
        lse, losses = merge_stats(stats, flat_targets, ignore_index)
        ctx.save_for_backward(rows, flat_targets, lse)
        ctx.meta = (vocab_start, n_valid, ignore_index, use_kernels, logits.shape)
        return losses.view(targets.shape)

    @staticmethod
    def backward(ctx, dloss):
        rows, flat_targets, lse = ctx.saved_tensors
        vocab_start, n_valid, ignore_index, use_kernels, shape = ctx.meta
        dlogits = shard_grad(rows, flat_targets, lse, dloss.reshape(-1).contiguous(), n_valid, vocab_start,
                             ignore_index, use_kernels)
        return dlogits.view(shape), None, None, None, None, None, None


def _check_targets(op: str, logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, ignore_index: int):
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: targets have shape {list(targets.shape)}; expected logits' leading dims "
                         f"{list(logits.shape[:-1])}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: targets must be int64 or int32 class indices, got {targets.dtype}")
    check_target_range(targets, vocab_size, ignore_index, f"{op}: ")


def check_target_range(targets: torch.Tensor, vocab_size: int, ignore_index: int, what: str = "") -> None:
    """Every target in [0, vocab_size) or ignore_index, checked without reading a value on the host.

    On a GPU `torch._assert_async` fails on the device (a device-side assert) instead of stalling
    the host on `bool(...)` each forward, and it can be captured in a CUDA graph. On the CPU it
    raises at once; the ValueError keeps the message that names the bad target.
    """
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    message = f"{what}a target lies outside [0, {vocab_size}) and is not ignore_index={ignore_index}"
    try:
        torch._assert_async(torch.logical_not(bad.any()), message)
    except RuntimeError as error:
        raise ValueError(message) from error


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses (float32, 0 where targets == ignore_index) of logits [..., V], targets [...]."""
    vocab = logits.shape[-1]
    _check_targets("cross_entropy", logits, targets, vocab, ignore_index)
    if logits.numel() == 0 or not use_triton(logits):
        return cross_entropy_reference(logits, targets, ignore_index)
    check_same_device("cross_entropy", logits, targets)
    check_float_dtype("cross_entropy", logits, "logits")
    return _ShardedCrossEntropyFunction.apply(logits, targets, 0, vocab, None, int(ignore_index), True)


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start_index: int,
                                 tp_group, ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token losses (float32) of logits split by vocabulary over tp_group, with ONE all-reduce.

    logits_shard [..., V/tp] holds global columns [vocab_start_index, vocab_start_index + V/tp);
    targets [...] are global indices, the same on every rank; columns >= vocab_size (padding)
    are excluded (vocab_size=None: no padding). Every rank gets the same losses, equal to
    F.cross_entropy(full_logits[..., :vocab_size], targets, reduction="none"); backward gives
    each rank the gradient of its own shard without communication.
    """
    shard_cols = logits_shard.shape[-1]
    tp = comm.group_size(tp_group)
    total = vocab_size if vocab_size is not None else tp * shard_cols
    if vocab_start_index < 0 or total > tp * shard_cols:  # a shard may be all padding (start >= total)
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_start_index={vocab_start_index}, "
                         f"vocab_size={vocab_size} do not fit {tp} shards of {shard_cols} columns")
    _check_targets("vocab_parallel_cross_entropy", logits_shard, targets, total, ignore_index)
    n_valid = max(0, min(shard_cols, total - vocab_start_index))  # columns of this shard inside the vocab
    use_kernels = logits_shard.numel() > 0 and use_triton(logits_shard)
    if use_kernels:
        check_same_device("vocab_parallel_cross_entropy", logits_shard, targets)
        check_float_dtype("vocab_parallel_cross_entropy", logits_shard, "logits_shard")
    return _ShardedCrossEntropyFunction.apply(logits_shard, targets, int(vocab_start_index), n_valid, tp_group,
                                              int(ignore_index), use_kernels)
