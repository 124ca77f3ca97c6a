"""Norms for a user's own model under sequence parallelism, and the declaration they need.

With `sequence_parallel=True` (Korthikanti et al. 2022) the activations between a row-parallel
and the next column-parallel layer are a sequence shard [s/tp, b, h]: each tp rank normalises
other tokens with the same (replicated) weight, so each rank's weight gradient is a PARTIAL sum
over its tokens. The data-parallel wrapper sums such gradients over tp before the dp reduction,
but only for parameters declared so; an undeclared norm silently trains on 1/tp of its gradient.

    norm = LayerNorm(h, sequence_parallel=True)        # or RMSNorm(h, sequence_parallel=True)
    mark_sequence_parallel(my_own_norm)                # any module: its parameters see a shard
    mark_sequence_parallel(final_norm, False)          # this one sees the whole sequence

`DataParallel` refuses a model holding sequence-parallel layers next to a norm whose parameters
nobody declared either way (`sequence_parallel.unmarked_norm_problem`), naming the module and the fix.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite import ops
from megalite.tensor_parallel.sequence_parallel import mark_sequence_parallel


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with replicated weight and bias [h]; megalite's kernel on CUDA.

    sequence_parallel=True: the input is a sequence shard [s/tp, b, h] and the parameters are
    declared to hold partial gradients (see the module docstring). At tp = 1 it is nn.LayerNorm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, *,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        mark_sequence_parallel(self, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (statistics in fp32) with a replicated weight [h]; see LayerNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, *,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps, self.sequence_parallel = eps, sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        mark_sequence_parallel(self, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
