"""tanh-approximated GeLU (Hendrycks & Gimpel 2016), optionally fused with the bias add before it.

    gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))    == F.gelu(x, approximate="tanh")

Elementwise over the flattened tensor in fp32. `bias_gelu(x, bias)` = gelu(x + bias) with bias
[n] broadcast over x's last dim (the sum is rounded to x.dtype like torch's `x + bias`);
backward recomputes x + bias instead of saving it, and dbias = sum of dx over rows.
tanh(u) is written as 2*sigmoid(2u) - 1 (Triton has sigmoid on every backend, no tanh).
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check_float_dtype, check_same_device, new_output, runnable, tl, triton, use_triton

BLOCK = 1024
SQRT_2_OVER_PI = 0.7978845608028654
GELU_COEF = 0.044715


def gelu_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + bias, approximate="tanh")


@triton.jit
def _gelu_forward_kernel(X, BIAS, Y, n_elements, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = (x + tl.load(BIAS + offs % n_cols, mask=mask, other=0.0).to(tl.float32)).to(Y.dtype.element_ty)
        x = x.to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tanh_inner = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    tl.store(Y + offs, (0.5 * x * (1.0 + tanh_inner)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_backward_kernel(DY, X, BIAS, DX, n_elements, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = (x + tl.load(BIAS + offs % n_cols, mask=mask, other=0.0).to(tl.float32)).to(DX.dtype.element_ty)
        x = x.to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tanh_inner = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    slope = 0.5 * (1.0 + tanh_inner) + 0.5 * x * (1.0 - tanh_inner * tanh_inner) * d_inner
    tl.store(DX + offs, (dy * slope).to(DX.dtype.element_ty), mask=mask)


def _launch(kernel, grid_elements, *args, **meta):
    runnable(kernel, args[0].device)[(cdiv(grid_elements, BLOCK),)](*args, BLOCK=BLOCK, num_warps=4, **meta)


class _BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x_flat = x.contiguous()
        bias_flat = bias.contiguous() if bias is not None else x_flat
        y = new_output(x.shape, x.dtype, x.device)
        _launch(_gelu_forward_kernel, x.numel(), x_flat, bias_flat, y, x.numel(), x.shape[-1],
                HAS_BIAS=bias is not None)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x_flat, bias_flat)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_flat, bias_flat = ctx.saved_tensors
        dy = dy.contiguous()
        dx = new_output(x_flat.shape, x_flat.dtype, x_flat.device)
        _launch(_gelu_backward_kernel, x_flat.numel(), dy, x_flat, bias_flat, dx, x_flat.numel(), x_flat.shape[-1],
                HAS_BIAS=ctx.has_bias)
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(bias_flat.dtype)
        return dx, dbias


def gelu(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GeLU, elementwise; same function as F.gelu(x, approximate="tanh")."""
    if x.numel() == 0 or not use_triton(x):
        return gelu_reference(x)
    check_float_dtype("gelu", x)
    return _BiasGeluFunction.apply(x, None)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias), bias [n] broadcast over x [..., n]; the sum rounded to x.dtype."""
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: bias has shape {list(bias.shape)} but x's last dim is {x.shape[-1]}; "
                         f"pass a 1-D bias of size {x.shape[-1]}")
    if x.numel() == 0 or not use_triton(x):
        return bias_gelu_reference(x, bias)
    check_same_device("bias_gelu", x, bias)
    check_float_dtype("bias_gelu", x)
    check_float_dtype("bias_gelu", bias, "bias")
    return _BiasGeluFunction.apply(x, bias)
