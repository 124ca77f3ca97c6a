"""LayerNorm (Ba et al. 2016), optionally fused with the residual add before it.

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      over the last dim, fp32 math

Same structure as rms_norm.py: forward one program per row saving mean and rstd (fp32 [rows]);
backward a fixed number of programs over row ranges, each writing dx and fp32 partial
weight/bias gradients ([programs, n] each) that torch sums afterwards.

    x_hat = (x - mean) * rstd
    dx = rstd * (w*dy - mean(w*dy) - x_hat * mean(x_hat * w*dy));  dw = sum dy*x_hat;  db = sum dy

`layer_norm_residual(x, residual, weight, bias)` returns (layer_norm(x + residual), x + residual)
with the sum rounded to x.dtype first, like `x + residual` in torch.
"""
from __future__ import annotations

import torch

from .dispatch import as_rows, new_output, num_programs_hint, runnable, tl, triton, use_triton
from .rms_norm import _check, _check_triton, _launch_config


def layer_norm_reference(x, weight, bias, eps: float = 1e-5):
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def layer_norm_residual_reference(x, residual, weight, bias, eps: float = 1e-5):
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps), summed


@triton.jit
def _layer_norm_forward_kernel(X, R, SUM, Y, W, B, MEAN, RSTD, x_row_stride, r_row_stride, n_cols, eps,
                               HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(SUM.dtype.element_ty)  # round like torch's x + residual
        tl.store(SUM + row * n_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (centered * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_backward_kernel(DY, DSUM, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, dy_row_stride,
                                dsum_row_stride, n_rows, n_cols, rows_per_program, HAS_DSUM: tl.constexpr,
                                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    x_ptrs = X + row_start * n_cols + cols  # walk the rows by pointer increments (int64-safe)
    dx_ptrs = DX + row_start * n_cols + cols
    dy_ptrs = DY + row_start * dy_row_stride + cols
    dsum_ptrs = DSUM + row_start * dsum_row_stride + cols
    for row in range(row_start, row_end):
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * tl.load(RSTD + row), 0.0)
        w_dy = w * dy
        mean_w_dy = tl.sum(w_dy, axis=0) / n_cols
        mean_xhat_w_dy = tl.sum(x_hat * w_dy, axis=0) / n_cols
        dx = (w_dy - mean_w_dy - x_hat * mean_xhat_w_dy) * tl.load(RSTD + row)
        if HAS_DSUM:  # gradient flowing into the residual stream from later layers
            dx += tl.load(dsum_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
        x_ptrs += n_cols
        dx_ptrs += n_cols
        dy_ptrs += dy_row_stride
        dsum_ptrs += dsum_row_stride
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=mask)


def _forward(x_rows, residual_rows, weight, bias, eps):
    """x_rows, residual_rows: [rows, n] -> (y, summed or None, mean [rows] fp32, rstd [rows] fp32)."""
    n_rows, n_cols = x_rows.shape
    block, num_warps = _launch_config(n_cols)
    device = x_rows.device
    y = new_output((n_rows, n_cols), x_rows.dtype, device)
    mean = new_output((n_rows,), torch.float32, device)
    rstd = new_output((n_rows,), torch.float32, device)
    has_residual = residual_rows is not None
    summed = new_output((n_rows, n_cols), x_rows.dtype, device) if has_residual else y
    runnable(_layer_norm_forward_kernel, device)[(n_rows,)](
        x_rows, residual_rows if has_residual else x_rows, summed, y, weight, bias, mean, rstd,
        x_rows.stride(0), residual_rows.stride(0) if has_residual else 0, n_cols, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps)
    return y, (summed if has_residual else None), mean, rstd


def _backward(dy, dsum, x_saved, weight, bias, mean, rstd):
    """dy, dsum: [..., n]; x_saved: the normalised input [rows, n] -> (dx [rows, n], dweight, dbias)."""
    n_rows, n_cols = x_saved.shape
    device = x_saved.device
    dy_rows = as_rows(dy)
    dsum_rows = as_rows(dsum) if dsum is not None else None
    block, num_warps = _launch_config(n_cols)
    programs = max(1, min(n_rows, num_programs_hint(device)))
    dx = new_output((n_rows, n_cols), x_saved.dtype, device)
    dw_partial = new_output((programs, n_cols), torch.float32, device)
    db_partial = new_output((programs, n_cols), torch.float32, device)
    runnable(_layer_norm_backward_kernel, device)[(programs,)](
        dy_rows, dsum_rows if dsum is not None else dy_rows, x_saved, weight, mean, rstd, dx, dw_partial,
        db_partial, dy_rows.stride(0), dsum_rows.stride(0) if dsum is not None else 0, n_rows, n_cols,
        triton.cdiv(n_rows, programs), HAS_DSUM=dsum is not None, BLOCK=block, num_warps=num_warps)
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(bias.dtype)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x_rows = as_rows(x)
        y, _, mean, rstd = _forward(x_rows, None, weight, bias, eps)
        ctx.save_for_backward(x_rows if x_rows.is_contiguous() else x_rows.contiguous(), weight, bias, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _backward(dy, None, *ctx.saved_tensors)
        return dx.view(dy.shape), dw, db, None


class _LayerNormResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        y, summed, mean, rstd = _forward(as_rows(x), as_rows(residual), weight, bias, eps)
        ctx.save_for_backward(summed, weight, bias, mean, rstd)
        return y.view(x.shape), summed.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum):
        summed = ctx.saved_tensors[0]
        if dy is None:
            dy = torch.zeros_like(summed)
        dx, dw, db = _backward(dy, dsum, *ctx.saved_tensors)
        dx = dx.view(dy.shape)
        return dx, dx, dw, db, None


class _LayerNormTorchFunction(torch.autograd.Function):
    """The PyTorch path for 16-bit x, keeping what the kernels keep: x in its own dtype and fp32
    mean and rstd per row (the reference's autograd would keep an fp32 copy of x, 2x the bytes)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        var, mean = torch.var_mean(x.float(), dim=-1, correction=0, keepdim=True)  # [..., 1] fp32
        rstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return layer_norm_reference(x, weight, bias, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        x_hat, dy = (x.float() - mean) * rstd, dy.float()
        w_dy = dy * weight.float()
        dx = (w_dy - w_dy.mean(-1, keepdim=True) - x_hat * (x_hat * w_dy).mean(-1, keepdim=True)) * rstd
        rows = tuple(range(dy.dim() - 1))
        return dx.to(x.dtype), (dy * x_hat).sum(rows).to(weight.dtype), dy.sum(rows).to(bias.dtype), None


def _check_bias(op: str, x, bias) -> None:
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: bias has shape {list(bias.shape)} but x's last dim is {x.shape[-1]}; "
                         f"pass a 1-D bias of size {x.shape[-1]}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., n] with weight, bias [n]; fp32 math, returns x.dtype."""
    _check("layer_norm", x, weight)
    _check_bias("layer_norm", x, bias)
    if x.numel() == 0 or not use_triton(x):
        if x.dtype in (torch.float16, torch.bfloat16) and x.numel() > 0:
            return _LayerNormTorchFunction.apply(x, weight, bias, float(eps))
        return layer_norm_reference(x, weight, bias, eps)
    _check_triton("layer_norm", x, weight, bias)
    return _LayerNormFunction.apply(x, weight, bias, float(eps))


def layer_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual), the sum rounded to x.dtype; both differentiable."""
    _check("layer_norm_residual", x, weight)
    _check_bias("layer_norm_residual", x, bias)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"layer_norm_residual: residual {list(residual.shape)} {residual.dtype} must match "
                         f"x {list(x.shape)} {x.dtype}")
    if x.numel() == 0 or not use_triton(x):
        return layer_norm_residual_reference(x, residual, weight, bias, eps)
    _check_triton("layer_norm_residual", x, residual, weight, bias)
    return _LayerNormResidualFunction.apply(x, residual, weight, bias, float(eps))
