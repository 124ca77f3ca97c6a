"""An MoE layer's local experts in FP8: fc1 and fc2 of all local experts as two grouped FP8 GEMMs.

x [R, h] rows sorted by local expert, group_sizes [E_local]: expert e takes its rows
[R_e, h] -> fc1 [R_e, 2f/tp] -> SwiGLU/GeLU [R_e, f/tp] -> fc2 [R_e, h] (partial over tp).
fc1 is column-parallel over the experts' tp group, fc2 row-parallel, so their amaxes reduce over
it as the dense MLP's do: megalite.fp8.grouped scales each expert as its own tensor and runs the
grouped GEMM (the bf16 path's kernels with FP8 operands; one _scaled_mm per expert on torch).
`per_expert_reference` is the same maths one expert after another through the FP8 linear: the
grouped path casts its bits (tests/fp8/test_fp8_experts.py). An expert that received no token
gets a zero gradient.
"""
from __future__ import annotations

import torch

from megalite.fp8.grouped import fp8_grouped_mm
from megalite.fp8.linear import fp8_linear
from megalite import ops


def fp8_experts_forward(experts, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """`experts`: a moe.experts.LocalExperts with `fp8` set. Returns [R, h], partial over tp."""
    recipe, group, local, tokens = experts.fp8, experts.tp_group, list(experts.values()), experts.fp8_tokens
    if recipe.blockwise:  # its scales change along each contraction: one expert after another
        return per_expert_reference(experts, x, group_sizes)
    y = fp8_grouped_mm(x, group_sizes, [e.fc1_weight for e in local], recipe, group, "column", tokens)  # [R, 2f/tp]|[R, f/tp]
    if experts.gated:
        gate, up = y.chunk(2, dim=-1)
        y = ops.swiglu(gate, up)
    else:
        y = ops.gelu(y)
    return fp8_grouped_mm(y, group_sizes, [e.fc2_weight for e in local], recipe, group, "row", tokens)  # [R, h]


def per_expert_reference(experts, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The same, one expert after another through the FP8 linear (reads the group sizes on the host)."""
    recipe, group, tokens = experts.fp8, experts.tp_group, experts.fp8_tokens
    outputs = []
    for expert, rows in zip(experts.values(), x.split(group_sizes.tolist(), dim=0)):
        y = fp8_linear(rows, expert.fc1_weight, None, recipe, group, "column", tokens=tokens)  # [R_e, 2f/tp]|[R_e, f/tp]
        if experts.gated:
            gate, up = y.chunk(2, dim=-1)
            y = ops.swiglu(gate, up)
        else:
            y = ops.gelu(y)
        outputs.append(fp8_linear(y, expert.fc2_weight, None, recipe, group, "row", tokens=tokens))  # [R_e, h]
    return torch.cat(outputs, dim=0)
