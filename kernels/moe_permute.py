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

from .dispatch import check_float_dtype, check_same_device, new_output, runnable, tl, triton, use_triton


def _check_permute_inputs(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    if x.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"permute_tokens: x must be [tokens, hidden] and expert_ids [tokens, k]; got x "
                         f"{list(x.shape)} and expert_ids {list(expert_ids.shape)}")
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"permute_tokens: expert_ids has dtype {expert_ids.dtype}; pass int64 (e.g. topk indices)")
    if num_experts < 1:
        raise ValueError(f"permute_tokens: num_experts={num_experts} must be >= 1")


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_index [R], group_sizes [E]) of expert_ids [T, k]: routed slots ordered by expert,
    ties in flat (token, slot) order. R = number of slots with an id >= 0: reading it is this
    module's one host synchronisation (the output's row count depends on the routing)."""
    flat = expert_ids.reshape(-1)
    keys = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)  # dropped slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    group_sizes = counts[:num_experts]
    order = torch.sort(keys, stable=True).indices
    routed = flat.numel() - int(counts[num_experts])  # host sync: R
    return order[:routed], group_sizes


def row_of_slot(sorted_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The inverse of sorted_index: int64 [num_slots], the permuted row of each flat slot, -1 if dropped."""
    rows = torch.full((num_slots,), -1, dtype=torch.int64, device=sorted_index.device)
    rows[sorted_index] = torch.arange(sorted_index.numel(), dtype=torch.int64, device=sorted_index.device)
    return rows


def permute_tokens_reference(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """Plain PyTorch: index x's rows by the stable sort of the expert ids."""
    _check_permute_inputs(x, expert_ids, num_experts)
    sorted_index, group_sizes = sort_by_expert(expert_ids, num_experts)
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


def permute_tokens(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """x [T, H] -> (permuted [R, H] sorted by expert, sorted_index int64 [R], group_sizes int64 [E]).

    Differentiable in x (dx[t] sums the gradients of t's routed rows). See the module docstring.
    """
    return permute_tokens_reference(x, expert_ids, num_experts)


def unpermute_tokens(y: torch.Tensor, sorted_index: torch.Tensor, weights: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """y [R, H] sorted by expert -> out [num_tokens, H], each token the routing-weighted sum of its rows.

    Differentiable in y and weights (a dropped slot's weight gets a zero gradient).
    """
    return unpermute_tokens_reference(y, sorted_index, weights, num_tokens)
