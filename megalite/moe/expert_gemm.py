"""The experts' grouped GEMM with their weights saved uncopied (one autograd node per GEMM).

A grouped GEMM takes one weight [E, K, N]; this rank's experts hold one parameter each. Stacking them
(torch.stack) and handing the stack to the kernel's own autograd node made that node save the stack
for backward: a copy of every local expert's weights for every microbatch in flight (Mixtral at
ep 1: 110 GB of "activations" on stage 0 where the planner counts 20.8; docs/simulate.md). Here the
stack is a temporary of the forward and of the backward, freed as soon as the GEMM has read it; the
node saves the input rows and the parameters themselves (references, no bytes), and hands each
expert's parameter its own slice of the weight gradient.

    expert_grouped_mm(x [R, K], group_sizes int64 [E], weights E x [N, K]) -> [R, N]
        rows of expert g times weights[g]^T (the parameters are stored [out, in], as nn.Linear's)

Same numbers as grouped_mm(x, torch.stack([w.t() for w in weights]), group_sizes) forward and
backward: the forward is that call, the backward is the kernel's own (kernels.grouped_mm_grads).
"""
from __future__ import annotations

import torch

from megalite import ops
from megalite.kernels import grouped_mm_grads


def _stack(weights) -> torch.Tensor:
    """E x [N, K] -> [E, K, N], a fresh tensor (the kernel's weight layout)."""
    return torch.stack([w.t() for w in weights])


class _ExpertGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, *weights):
        ctx.save_for_backward(x, group_sizes, *weights)  # parameters: saved by reference, not copied
        with torch.no_grad():
            return ops.grouped_mm(x, _stack(weights), group_sizes)

    @staticmethod
    def backward(ctx, dy):
        x, group_sizes, *weights = ctx.saved_tensors
        need_dx, need_dweight = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        dx, dweight = grouped_mm_grads(x, _stack(weights), group_sizes, dy, need_dx, need_dweight)
        # dweight [E, K, N]: expert g's parameter [N, K] gets dweight[g]^T, as stack/t's backward gave it
        dweights = [dweight[g].t() for g in range(len(weights))] if need_dweight else [None] * len(weights)
        return (dx, None, *dweights)


def expert_grouped_mm(x: torch.Tensor, group_sizes: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [R, K] rows sorted by expert, group_sizes int64 [E], weights E x [N, K] -> [R, N]."""
    return _ExpertGroupedMM.apply(x, group_sizes, *weights)
