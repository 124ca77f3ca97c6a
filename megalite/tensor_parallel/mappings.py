"""Autograd region functions: the communication at the edges of tensor-parallel regions.

Names follow Megatron-LM's vocabulary (Shoeybi et al. 2019, "f" and "g" operators; Korthikanti
et al. 2022 for sequence parallelism). Each function is an autograd pair whose forward and
backward are conjugate collectives over the tensor-parallel group:

| function                                   | forward                      | backward                     |
|--------------------------------------------|------------------------------|------------------------------|
| copy_to_tensor_parallel_region (f)         | identity                     | all-reduce                   |
| reduce_from_tensor_parallel_region (g)     | all-reduce                   | identity                     |
| scatter_to_tensor_parallel_region          | keep my slice of last dim    | all-gather last dim          |
| gather_from_tensor_parallel_region         | all-gather last dim          | keep my slice of last dim    |
| scatter_to_sequence_parallel_region        | keep my slice of dim 0 (seq) | all-gather dim 0             |
| gather_from_sequence_parallel_region       | all-gather dim 0             | reduce-scatter dim 0 (*)     |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 0         | all-gather dim 0             |

(*) when the gathered tensor feeds a column-parallel layer, each rank's gradient is a partial
sum, so backward reduce-scatters; pass `grad_is_partial=False` when every rank already holds
the full gradient and a plain split suffices.

scatter_to_ and gather_from_sequence_parallel_region also take `sizes=`: an uneven split of dim 0
(rank i's slice sizes[i] rows), for a token count the group does not divide (megalite/distributed/uneven.py).

All go through `megalite.distributed.comm`; `group=None` (or a group of one) makes every function the identity.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm, uneven


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} across {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[comm.group_rank(group)].contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # Reduce a copy: autograd may hand the same gradient tensor to other consumers.
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=-1), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _split(x, group, 0) if sizes is None else uneven.split(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sizes is None:
            return comm.all_gather(grad, ctx.group, dim=0), None, None
        return uneven.all_gather(grad.contiguous(), ctx.group, ctx.sizes), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial, sizes):
        ctx.group, ctx.grad_is_partial, ctx.sizes = group, grad_is_partial, sizes
        return comm.all_gather(x, group, dim=0) if sizes is None else uneven.all_gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sizes is not None:
            if ctx.grad_is_partial:
                return uneven.reduce_scatter(grad, ctx.group, ctx.sizes), None, None, None
            return uneven.split(grad, ctx.group, ctx.sizes), None, None, None
        if ctx.grad_is_partial:
            return comm.reduce_scatter(grad, ctx.group, dim=0), None, None, None
        return _split(grad, ctx.group, 0), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient over `group` (the "f" operator)."""
    return _CopyToTensorParallelRegion.apply(x, group) if comm.group_size(group) > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce (sum) over `group`. Backward: identity (the "g" operator)."""
    return _ReduceFromTensorParallelRegion.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""
    return _ScatterToTensorParallelRegion.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's slice of the last dim."""
    return _GatherFromTensorParallelRegion.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, *, sizes: list[int] | None = None) -> torch.Tensor:
    """Forward: [s, ...] -> [s/tp, ...] (this rank's slice). Backward: all-gather dim 0.
    sizes: an uneven split, rank i's slice sizes[i] rows (megalite.distributed.uneven.split_sizes)."""
    return _ScatterToSequenceParallelRegion.apply(x, group, sizes) if comm.group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, group, grad_is_partial: bool = True, *,
                                         sizes: list[int] | None = None) -> torch.Tensor:
    """Forward: [s/tp, ...] -> [s, ...] (all-gather). Backward: reduce-scatter dim 0
    (or a plain split when `grad_is_partial=False`). sizes: an uneven split, rank i's slice sizes[i] rows."""
    if comm.group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial, sizes)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: [s, ...] partial sums -> [s/tp, ...] reduced slice. Backward: all-gather dim 0."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group) if comm.group_size(group) > 1 else x
