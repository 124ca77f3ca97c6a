"""The dense tensor-parallel MLP (a transformer block's, and an MoE layer's shared expert), and the
weight initialisers the model's tensor-parallel layers use.

It lives here, below both model/ (TransformerBlock) and moe/ (MoELayer's shared expert), so
neither imports the other for it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megalite import ops
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def normal_init(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def zeros_init(b: torch.Tensor):
    return nn.init.zeros_(b)


class MLP(nn.Module):
    """gpt2: fc1 (h -> f) -> tanh-GeLU -> fc2 (f -> h). llama: gate_up (h -> [gate; up]) -> SwiGLU -> down.

    config: a GPTConfig (hidden_size, ffn_hidden_size, flavour, init_std, num_layers, mlp_bias).
    x [s, b, h] ([s/tp, b, h] under sequence parallelism) -> the same shape.
    """

    def __init__(self, config, tp_group, *, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.gated = config.flavour == "llama"
        init = normal_init(config.init_std)
        out_init = normal_init(config.init_std / math.sqrt(2 * config.num_layers))
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, bias_init_method=zeros_init,
                      dtype=dtype, device=device)
        self.fc1 = ColumnParallelLinear(h, 2 * f if self.gated else f, bias=config.mlp_bias, init_method=init,
                                        fused_blocks=(f, f) if self.gated else None, **common)
        self.fc2 = RowParallelLinear(f, h, bias=config.mlp_bias, init_method=out_init, **common)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves fc2's bias to the caller (the block's fused bias-dropout-add)."""
        y = self.fc1(x)  # [s, b, f/tp] or [s, b, 2f/tp] = [gate_r; up_r]
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = ops.swiglu(gate, up)
        else:
            y = ops.gelu(y)
        return self.fc2(y, add_bias=add_bias)
