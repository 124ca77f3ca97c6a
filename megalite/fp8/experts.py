"""An MoE layer's local experts in FP8: each expert's fc1 and fc2 through the FP8 linear.

x [R, h] rows sorted by local expert, group_sizes [E_local]: expert e takes its rows
[R_e, h] -> fc1 [R_e, 2f/tp] -> SwiGLU/GeLU [R_e, f/tp] -> fc2 [R_e, h] (partial over tp).
fc1 is column-parallel over the experts' tp group, fc2 row-parallel, so their amaxes reduce over
it as the dense MLP's do. One expert after another: torch has no grouped scaled GEMM yet, so this
reads the group sizes on the host (one sync per layer) where the bf16 path runs one grouped GEMM.
An expert that received no token still runs (an empty GEMM), so every rank joins the same amax
all-reduces and every expert weight gets its (zero) gradient.
"""
from __future__ import annotations

import torch

from megalite.fp8.linear import fp8_linear
from megalite import ops


def fp8_experts_forward(experts, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """`experts`: a moe.experts.LocalExperts with `fp8` set. Returns [R, h], partial over tp."""
    recipe, group = experts.fp8, experts.tp_group
    outputs = []
    for expert, rows in zip(experts.values(), x.split(group_sizes.tolist(), dim=0)):
        y = fp8_linear(rows, expert.fc1_weight, None, recipe, group, "column")  # [R_e, 2f/tp] or [R_e, f/tp]
        if experts.gated:
            gate, up = y.chunk(2, dim=-1)
            y = ops.swiglu(gate, up)
        else:
            y = ops.gelu(y)
        outputs.append(fp8_linear(y, expert.fc2_weight, None, recipe, group, "row"))  # [R_e, h]
    return torch.cat(outputs, dim=0)
