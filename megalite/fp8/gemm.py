"""The FP8 GEMM: out = (a_q * inv_a) @ (b_q * inv_b), in `out_dtype`.

a_q [M, K] row-major, b_q [K, N] column-major (a row-major [N, K] tensor's .t()), as
torch._scaled_mm wants. inv_a is [] or [M, 1], inv_b [] or [1, N]. Where torch has no kernel
for a combination (e5m2 x e5m2 on CUDA, rowwise with a non-bf16 output, dims not multiples of
16, an older GPU), the same maths runs dequantised in fp32: the numbers, not the speed, are
kept; `fallbacks` counts those calls so a benchmark can say so.
"""
from __future__ import annotations

import torch

fallbacks = 0
_UNSUPPORTED: set[tuple] = set()  # combinations _scaled_mm refused once: not tried again


def _key(a_q, b_q, inv_a, inv_b, out_dtype) -> tuple:
    return (a_q.device.type, a_q.dtype, b_q.dtype, inv_a.dim(), inv_b.dim(), out_dtype)


def _dense(scale: torch.Tensor) -> torch.Tensor:
    """Row-major strides even on size-1 dims (a [N, 1] made by .t() keeps stride N there)."""
    return scale.flatten().view(scale.shape) if scale.dim() else scale


def scaled_mm(a_q: torch.Tensor, b_q: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """[M, K] x [K, N] -> [M, N] (see the module docstring)."""
    global fallbacks
    if a_q.shape[1] == 0:  # an expert without tokens: CPU's _scaled_mm leaves a K = 0 output uninitialised
        return torch.zeros(a_q.shape[0], b_q.shape[1], dtype=out_dtype, device=a_q.device)
    key = _key(a_q, b_q, inv_a, inv_b, out_dtype)
    aligned = a_q.device.type == "cpu" or all(d % 16 == 0 for d in (*a_q.shape, b_q.shape[1]))
    if aligned and key not in _UNSUPPORTED:
        try:
            return torch._scaled_mm(a_q, b_q, scale_a=_dense(inv_a), scale_b=_dense(inv_b),
                                    out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError):
            _UNSUPPORTED.add(key)
    fallbacks += 1
    return ((a_q.float() * inv_a) @ (b_q.float() * inv_b)).to(out_dtype)
