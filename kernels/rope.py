"""Rotary position embedding (Su et al. 2021) in the rotate-half convention of HF Llama.

    x [s, b, n_heads, d];  cos, sin [s, d] (the two halves duplicated, as HF builds them), or
    [s, b, d]: a table per sample (packed documents: each sample's positions restart per document)
    rope(x) = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]

so with halves x = [x1, x2], cos = [c1, c2], sin = [s1, s2]:
    forward:   y1 = x1 c1 - x2 s1           y2 = x2 c2 + x1 s2
    backward:  dx1 = dy1 c1 + dy2 s2        dx2 = dy2 c2 - dy1 s1   (the transposed rotation)

One program per (position, batch) row handles all heads: a [heads, d/2] tile for each half.
x may have any strides (e.g. q sliced out of a fused qkv projection); the output is
contiguous. fp32 math, rounded once to x.dtype. cos and sin are constants: no gradient.
Backward is the same kernel with the rotation transposed, reading dy as it comes (any strides).
"""
from __future__ import annotations

import torch

from .dispatch import check_float_dtype, check_same_device, new_output, next_power_of_2, runnable, tl, triton, \
    use_triton


# Measured warps per program (tools/tune_norms.py) keyed by (BLOCK_H, BLOCK_HALF) on CUDA; else 4.
NUM_WARPS: dict[tuple[int, int], int] = {}


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    seq, _, _, dim = x.shape
    cos = cos.reshape(seq, -1, 1, dim).float()  # [s, 1 or b, 1, d]
    sin = sin.reshape(seq, -1, 1, dim).float()
    x_float = x.float()  # one cast, so the gradient is rounded to x.dtype once
    x1, x2 = x_float.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x_float * cos + rotated * sin).to(x.dtype)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, batch, n_heads, half, x_stride_s, x_stride_b, x_stride_h, x_stride_d,
                 cos_stride_s, cos_stride_b, sin_stride_s, sin_stride_b, TRANSPOSED: tl.constexpr,
                 BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # = position * batch + batch index
    pos = row // batch
    b = row % batch
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    x_base = X + pos * x_stride_s + b * x_stride_b + heads * x_stride_h
    x1 = tl.load(x_base + cols * x_stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + (cols + half) * x_stride_d, mask=mask, other=0.0).to(tl.float32)
    cos_row = COS + pos * cos_stride_s + b * cos_stride_b  # stride_b 0: one table for every sample
    sin_row = SIN + pos * sin_stride_s + b * sin_stride_b
    c1 = tl.load(cos_row + cols, mask=cols < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + cols, mask=cols < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    if TRANSPOSED:  # backward: dx = R^T dy
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_base = Y + row * n_heads * 2 * half + heads * 2 * half
    tl.store(y_base + cols, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_base + half + cols, y2.to(Y.dtype.element_ty), mask=mask)


def _num_warps(n_heads: int, head_dim: int, device: torch.device) -> int:
    """Warps per (position, batch) program for n_heads x head_dim (tools/tune_norms.py replaces this)."""
    measured = NUM_WARPS.get((next_power_of_2(n_heads), next_power_of_2(head_dim // 2))) if device.type == "cuda" \
        else None
    return measured or 4


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool) -> torch.Tensor:
    seq, batch, n_heads, dim = x.shape
    y = new_output((seq, batch, n_heads, dim), x.dtype, x.device)
    runnable(_rope_kernel, x.device)[(seq * batch,)](
        x, cos, sin, y, batch, n_heads, dim // 2, *x.stride(), *_table_strides(cos), *_table_strides(sin),
        TRANSPOSED=transposed, BLOCK_H=next_power_of_2(n_heads), BLOCK_HALF=next_power_of_2(dim // 2),
        num_warps=_num_warps(n_heads, dim, x.device))
    return y


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, transposed=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, transposed=True), None, None


def _table_strides(table: torch.Tensor) -> tuple[int, int]:
    """(position, sample) strides of a [s, d] or [s, b, d] table; 0 for the sample of a shared one."""
    return (table.stride(0), table.stride(1)) if table.dim() == 3 else (table.stride(0), 0)


def _as_table(name: str, table: torch.Tensor, seq: int, batch: int, dim: int) -> torch.Tensor:
    """cos/sin given as [s, d] (or [s, 1, 1, d], Megatron's layout) -> [s, d], or per sample [s, b, d];
    unit column stride."""
    if table.dim() == 3 and tuple(table.shape) == (seq, batch, dim):
        return table if table.stride(-1) == 1 else table.contiguous()
    if table.shape[0] != seq or table.shape[-1] != dim or table.numel() != seq * dim:
        raise ValueError(f"rope: {name} has shape {list(table.shape)}; expected [{seq}, {dim}] or [{seq}, {batch}, "
                         f"{dim}] (sequence length, batch and head dim of x [s, b, n_heads, d])")
    table = table.reshape(seq, dim)
    return table if table.stride(-1) == 1 else table.contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, n_heads, d] by cos, sin [s, d] or [s, b, d] (rotate-half convention); returns x.dtype."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x has shape {list(x.shape)}; expected [s, b, n_heads, d] with an even head dim d")
    seq, batch, _, dim = x.shape
    cos, sin = _as_table("cos", cos, seq, batch, dim), _as_table("sin", sin, seq, batch, dim)
    if x.numel() == 0 or not use_triton(x):
        return rope_reference(x, cos, sin)
    check_same_device("rope", x, cos, sin)
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_float_dtype("rope", t, name)
    return _RopeFunction.apply(x, cos, sin)
