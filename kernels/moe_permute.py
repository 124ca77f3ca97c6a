"""Mixture-of-experts token permutation: the rows of [tokens, hidden] sorted by expert for the
grouped GEMM, and back, weighted by the router.

    permute_tokens(x, expert_ids, num_experts) -> (permuted, sorted_index, group_sizes)
        x [T, H], expert_ids int64 [T, k] (ids in [0, E), or -1: this slot is not routed here)
        permuted [R, H]: permuted[r] = x[sorted_index[r] // k], R = number of routed slots
        sorted_index int64 [R]: the flat slot (token * k + slot) each row came from, ordered by
            expert with ties in flat order (token, then slot): a stable sort, so deterministic
        group_sizes int64 [E]: rows per expert (zeros allowed); sum == R
    unpermute_tokens(y, sorted_index, weights, num_tokens) -> out
        y [R, H] (rows as permute_tokens ordered them), weights [T, k] routing weights
        out [T, H]: out[t] = sum over t's routed slots s of weights[t, s] * y[row of (t, s)]

The sort is torch's (stable, on device). The row moves are Triton gathers, each output row
written by exactly one program from rows it reads: no atomics, so the backward is as
deterministic as the forward. Both directions are gathers thanks to `row_of_slot` [T * k], the
inverse of sorted_index (-1 for a dropped slot):

    permute forward       permuted[r] = x[sorted_index[r] // k]                 (gather rows)
    permute backward      dx[t] = sum_s dpermuted[row_of_slot[t*k + s]]          (combine slots)
    unpermute forward     out[t] = sum_s w[t, s] * y[row_of_slot[t*k + s]]       (combine slots)
    unpermute backward    dy[r] = w[slot r] * dout[sorted_index[r] // k]         (gather rows)
                          dw[slot r] = <dout[sorted_index[r] // k], y[r]>, 0 for a dropped slot

Math in fp32; y's rows and out in y.dtype, weights' gradient in weights.dtype.
"""
from __future__ import annotations

import torch

from .dispatch import (check_float_dtype, check_same_device, new_output, next_power_of_2, runnable, tl, triton,
                       use_triton)


def _check_permute_inputs(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"permute_tokens: x must be [tokens, hidden] and expert_ids [tokens, k]; got x "
                         f"{list(x.shape)} and expert_ids {list(expert_ids.shape)}")
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"permute_tokens: expert_ids has dtype {expert_ids.dtype}; pass int64 (e.g. topk indices)")
    if num_experts < 1:
        raise ValueError(f"permute_tokens: num_experts={num_experts} must be >= 1")


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int,
                   routed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_index [R], group_sizes [E]) of expert_ids [T, k]: routed slots ordered by expert,
    ties in flat (token, slot) order. R = number of slots with an id >= 0: reading it is this
    module's one host synchronisation (the output's row count depends on the routing), skipped when
    the caller gives it as `routed`."""
    flat = expert_ids.reshape(-1)
    keys = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)  # dropped slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    group_sizes = counts[:num_experts]
    order = torch.sort(keys, stable=True).indices
    if routed is None:
        routed = flat.numel() - int(counts[num_experts])  # host sync: R
    return order[:routed], group_sizes


def row_of_slot(sorted_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The inverse of sorted_index: int64 [num_slots], the permuted row of each flat slot, -1 if dropped."""
    rows = torch.full((num_slots,), -1, dtype=torch.int64, device=sorted_index.device)
    rows[sorted_index] = torch.arange(sorted_index.numel(), dtype=torch.int64, device=sorted_index.device)
    return rows


def permute_tokens_reference(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, routed: int | None = None):
    """Plain PyTorch: index x's rows by the stable sort of the expert ids."""
    _check_permute_inputs(x, expert_ids, num_experts)
    sorted_index, group_sizes = sort_by_expert(expert_ids, num_experts, routed)
    top_k = expert_ids.shape[1]
    return x[sorted_index // top_k], sorted_index, group_sizes


def unpermute_tokens_reference(y: torch.Tensor, sorted_index: torch.Tensor, weights: torch.Tensor,
                               num_tokens: int) -> torch.Tensor:
    """Plain PyTorch: index_add of the weighted rows into their tokens, in (at least) fp32."""
    _check_unpermute_inputs(y, sorted_index, weights, num_tokens)
    top_k = weights.shape[1]
    math_dtype = torch.promote_types(y.dtype, torch.float32)
    row_weights = weights.reshape(-1)[sorted_index].to(math_dtype)  # [R]
    out = torch.zeros(num_tokens, y.shape[1], dtype=math_dtype, device=y.device)
    out = out.index_add(0, sorted_index // top_k, y.to(math_dtype) * row_weights[:, None])
    return out.to(y.dtype)


def _check_unpermute_inputs(y: torch.Tensor, sorted_index: torch.Tensor, weights: torch.Tensor,
                            num_tokens: int) -> None:
    if y.dim() != 2 or sorted_index.shape != (y.shape[0],) or weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"unpermute_tokens: y must be [rows, hidden], sorted_index [rows] and weights "
                         f"[num_tokens={num_tokens}, k]; got y {list(y.shape)}, sorted_index "
                         f"{list(sorted_index.shape)}, weights {list(weights.shape)}")
    if sorted_index.dtype != torch.int64:
        raise TypeError(f"unpermute_tokens: sorted_index has dtype {sorted_index.dtype}; pass permute_tokens' int64")


@triton.jit
def _gather_rows_kernel(SRC, OUT, SORTED_INDEX, ROUTING_WEIGHTS, Y, DROUTING_WEIGHTS, n_cols, top_k, src_stride,
                        out_stride, y_stride, WEIGHTED: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """OUT[r] = w * SRC[SORTED_INDEX[r] // top_k] for permuted row r (w = ROUTING_WEIGHTS[slot] if
    WEIGHTED, else 1); with WEIGHT_GRAD also DROUTING_WEIGHTS[slot] = <SRC[token], Y[r]> (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(SORTED_INDEX + row)
    token = slot // top_k
    weight = tl.load(ROUTING_WEIGHTS + slot).to(tl.float32) if WEIGHTED else 1.0
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = cols < n_cols
        src = tl.load(SRC + token * src_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * out_stride + cols, (src * weight).to(OUT.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dot += src * tl.load(Y + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_GRAD:
        tl.store(DROUTING_WEIGHTS + slot, tl.sum(dot, axis=0))


@triton.jit
def _combine_slots_kernel(SRC, OUT, ROW_OF_SLOT, ROUTING_WEIGHTS, n_cols, top_k, src_stride, out_stride,
                          WEIGHTED: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT[t] = sum_s w[t, s] * SRC[ROW_OF_SLOT[t * top_k + s]] over t's routed slots (row >= 0), in
    fp32 (w = 1 unless WEIGHTED). A token without a routed slot gets zeros."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in range(0, top_k):
            row = tl.load(ROW_OF_SLOT + token * top_k + s)
            routed_cols = tl.where(row >= 0, n_cols, 0)  # a dropped slot (row -1) reads nothing
            src = tl.load(SRC + row * src_stride + cols, mask=cols < routed_cols, other=0.0).to(tl.float32)
            if WEIGHTED:  # a dropped slot's weight is read but multiplies zeros
                src *= tl.load(ROUTING_WEIGHTS + token * top_k + s).to(tl.float32)
            acc += src
        tl.store(OUT + token * out_stride + cols, acc.to(OUT.dtype.element_ty), mask=cols < n_cols)


def _block_h(n_cols: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 32  # the interpreter: a few chunks per row, so the tests cover the loop and its tail
    return min(1024, next_power_of_2(n_cols))


def _gather_rows(src: torch.Tensor, sorted_index: torch.Tensor, top_k: int, routing_weights=None, y=None):
    """[R, H] rows src[sorted_index // top_k] (times their slot's weight); with y also the weights' fp32
    gradient [T * k] (zero for dropped slots)."""
    out = new_output((sorted_index.shape[0], src.shape[1]), src.dtype, src.device)
    weight_grad = None  # [T * k]: src is then the output's gradient [T, H]
    if y is not None:
        weight_grad = torch.zeros(src.shape[0] * top_k, dtype=torch.float32, device=src.device)
    if sorted_index.shape[0] == 0:
        return out, weight_grad
    runnable(_gather_rows_kernel, src.device)[(sorted_index.shape[0],)](
        src, out, sorted_index, routing_weights if routing_weights is not None else src, y if y is not None else src,
        weight_grad if weight_grad is not None else src, src.shape[1], top_k, src.stride(0), out.stride(0),
        y.stride(0) if y is not None else 0, WEIGHTED=routing_weights is not None, WEIGHT_GRAD=y is not None,
        BLOCK_H=_block_h(src.shape[1], src.device), num_warps=4)
    return out, weight_grad


def _combine_slots(src: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int,
                   routing_weights=None) -> torch.Tensor:
    """[num_tokens, H]: each token's routed rows of src summed (weighted by routing_weights [T, k])."""
    out = new_output((num_tokens, src.shape[1]), src.dtype, src.device)
    runnable(_combine_slots_kernel, src.device)[(num_tokens,)](
        src, out, row_of_slot, routing_weights if routing_weights is not None else src, src.shape[1], top_k,
        src.stride(0), out.stride(0), WEIGHTED=routing_weights is not None,
        BLOCK_H=_block_h(src.shape[1], src.device), num_warps=4)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sorted_index, row_of_slot, top_k):
        ctx.save_for_backward(row_of_slot)
        ctx.top_k = top_k
        return _gather_rows(_rows(x), sorted_index, top_k)[0]

    @staticmethod
    def backward(ctx, d_permuted):
        (row_of_slot,) = ctx.saved_tensors
        num_tokens = row_of_slot.shape[0] // ctx.top_k
        return _combine_slots(_rows(d_permuted), row_of_slot, num_tokens, ctx.top_k), None, None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, routing_weights, sorted_index, row_of_slot):
        y, routing_weights = _rows(y), routing_weights.contiguous()
        ctx.save_for_backward(y, routing_weights, sorted_index)
        return _combine_slots(y, row_of_slot, routing_weights.shape[0], routing_weights.shape[1], routing_weights)

    @staticmethod
    def backward(ctx, d_out):
        y, routing_weights, sorted_index = ctx.saved_tensors
        wants_weight_grad = ctx.needs_input_grad[1]
        dy, d_weights = _gather_rows(_rows(d_out), sorted_index, routing_weights.shape[1], routing_weights,
                                     y if wants_weight_grad else None)
        if wants_weight_grad:
            d_weights = d_weights.view(routing_weights.shape).to(routing_weights.dtype)
        return dy, d_weights, None, None


def permute_tokens(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, routed: int | None = None):
    """x [T, H] -> (permuted [R, H] sorted by expert, sorted_index int64 [R], group_sizes int64 [E]).

    Differentiable in x (dx[t] sums the gradients of t's routed rows). See the module docstring.
    Reads R on the host (one synchronisation: the output's size depends on the routing) unless the
    caller knows it (`routed`).
    """
    _check_permute_inputs(x, expert_ids, num_experts)
    if x.numel() == 0 or not use_triton(x):
        return permute_tokens_reference(x, expert_ids, num_experts, routed)
    check_same_device("permute_tokens", x, expert_ids)
    check_float_dtype("permute_tokens", x, "x")
    sorted_index, group_sizes = sort_by_expert(expert_ids, num_experts, routed)
    top_k = expert_ids.shape[1]
    permuted = _PermuteFunction.apply(x, sorted_index, row_of_slot(sorted_index, expert_ids.numel()), top_k)
    return permuted, sorted_index, group_sizes


def unpermute_tokens(y: torch.Tensor, sorted_index: torch.Tensor, weights: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """y [R, H] sorted by expert -> out [num_tokens, H], each token the routing-weighted sum of its rows.

    Differentiable in y and weights (a dropped slot's weight gets a zero gradient). No host sync.
    """
    _check_unpermute_inputs(y, sorted_index, weights, num_tokens)
    if num_tokens == 0 or y.shape[1] == 0 or weights.shape[1] == 0 or not use_triton(y):
        return unpermute_tokens_reference(y, sorted_index, weights, num_tokens)
    check_same_device("unpermute_tokens", y, sorted_index, weights)
    check_float_dtype("unpermute_tokens", y, "y")
    check_float_dtype("unpermute_tokens", weights, "weights")
    return _UnpermuteFunction.apply(y, weights, sorted_index, row_of_slot(sorted_index, weights.numel()))
