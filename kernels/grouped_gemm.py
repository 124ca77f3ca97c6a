"""Grouped GEMM for mixture-of-experts: every expert's tokens times that expert's weight, in one launch.

    grouped_mm(x, weight, group_sizes) -> y
        x [T, K], rows sorted by group: group g owns rows offsets[g] .. offsets[g+1]
            (offsets = exclusive cumsum of group_sizes)
        weight [E, K, N]; group_sizes int64 [E] on x's device, zeros allowed, sum == T
        y [T, N]: y[rows of g] = x[rows of g] @ weight[g]
    backward: dx[rows of g] = dy[rows of g] @ weight[g]^T
              dweight[g]    = x[rows of g]^T @ dy[rows of g]   (zeros for a group without rows)

fp32 accumulation; y, dx and dweight in the inputs' dtype (bf16, fp16 or fp32).
"""
from __future__ import annotations

import torch

from .dispatch import check_float_dtype, check_same_device, new_output, runnable, tl, triton, use_triton


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_mm: x must be [tokens, K] and weight [experts, K, N]; got x {list(x.shape)} "
                         f"and weight {list(weight.shape)}")
    if group_sizes.shape != (weight.shape[0],) or group_sizes.dtype != torch.int64:
        raise ValueError(f"grouped_mm: group_sizes must be int64 [experts={weight.shape[0]}]; got "
                         f"{group_sizes.dtype} {list(group_sizes.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_mm: x is {x.dtype} but weight is {weight.dtype}; cast one to the other")


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: one matmul per group in (at least) fp32 (reads the sizes on the host)."""
    _check_inputs(x, weight, group_sizes)
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    pieces = torch.split(x, group_sizes.tolist())
    out = [(piece.to(math_dtype) @ weight[g].to(math_dtype)).to(x.dtype) for g, piece in enumerate(pieces)]
    return torch.cat(out) if out else x.new_zeros(0, weight.shape[2])


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x [T, K] sorted by group, weight [E, K, N], group_sizes int64 [E] -> y [T, N]. See the module docstring."""
    return grouped_mm_reference(x, weight, group_sizes)
