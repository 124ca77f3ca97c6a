"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add before it.

    y = x / sqrt(mean(x^2) + eps) * weight          over the last dim, computed in fp32

Forward: one program per row; the row's 1/rms (`rstd`, fp32 [rows]) is saved for backward.
Backward: a fixed number of programs, each walking a contiguous range of rows, writes dx and
accumulates its own partial weight gradient in fp32 ([programs, n]); the partials are summed
by torch afterwards (no atomics, deterministic).

    x_hat = x * rstd;  dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy));  dw = sum_rows dy * x_hat

The residual variant `rms_norm_residual(x, residual, weight)` returns (normed, x + residual),
the pre-norm transformer's `h = h + f(h); y = norm(h)` in one pass: the sum is rounded to
x.dtype first (exactly as `x + residual` in torch) and that rounded sum is normalised.
"""
from __future__ import annotations

import torch

from .dispatch import as_rows, check_float_dtype, check_same_device, new_output, num_programs_hint, \
    next_power_of_2, runnable, tl, triton, use_triton

MAX_HIDDEN = 65536  # one row lives in registers/SRAM of one program


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def rms_norm_residual_reference(x, residual, weight, eps: float = 1e-6):
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@triton.jit
def _rms_norm_forward_kernel(X, R, SUM, Y, W, RSTD, x_row_stride, r_row_stride, n_cols, eps,
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
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(DY, DSUM, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride, dsum_row_stride,
                              n_rows, n_cols, rows_per_program, HAS_DSUM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    x_ptrs = X + row_start * n_cols + cols  # walk the rows by pointer increments (int64-safe)
    dx_ptrs = DX + row_start * n_cols + cols
    dy_ptrs = DY + row_start * dy_row_stride + cols
    dsum_ptrs = DSUM + row_start * dsum_row_stride + cols
    for row in range(row_start, row_end):
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        w_dy = w * dy
        dx = (w_dy - x_hat * (tl.sum(x_hat * w_dy, axis=0) / n_cols)) * rstd
        if HAS_DSUM:  # gradient flowing into the residual stream from later layers
            dx += tl.load(dsum_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        x_ptrs += n_cols
        dx_ptrs += n_cols
        dy_ptrs += dy_row_stride
        dsum_ptrs += dsum_row_stride
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))  # (BLOCK, num_warps)


def _forward(x_rows, residual_rows, weight, eps):
    """x_rows, residual_rows: [rows, n] -> (y [rows, n], summed [rows, n] or None, rstd [rows] fp32)."""
    n_rows, n_cols = x_rows.shape
    block, num_warps = _launch_config(n_cols)
    y = new_output((n_rows, n_cols), x_rows.dtype, x_rows.device)
    rstd = new_output((n_rows,), torch.float32, x_rows.device)
    has_residual = residual_rows is not None
    summed = new_output((n_rows, n_cols), x_rows.dtype, x_rows.device) if has_residual else y
    kernel = runnable(_rms_norm_forward_kernel, x_rows.device)
    kernel[(n_rows,)](x_rows, residual_rows if has_residual else x_rows, summed, y, weight, rstd,
                      x_rows.stride(0), residual_rows.stride(0) if has_residual else 0, n_cols, eps,
                      HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=num_warps)
    return y, (summed if has_residual else None), rstd


def _backward(dy, dsum, x_saved, weight, rstd):
    """dy, dsum: [..., n]; x_saved: the normalised input [rows, n] -> (dx [rows, n], dweight)."""
    n_rows, n_cols = x_saved.shape
    dy_rows = as_rows(dy)
    dsum_rows = as_rows(dsum) if dsum is not None else None
    block, num_warps = _launch_config(n_cols)
    programs = max(1, min(n_rows, num_programs_hint(dy.device)))
    rows_per_program = triton.cdiv(n_rows, programs)
    dx = new_output((n_rows, n_cols), x_saved.dtype, x_saved.device)
    dw_partial = new_output((programs, n_cols), torch.float32, x_saved.device)
    kernel = runnable(_rms_norm_backward_kernel, dy.device)
    kernel[(programs,)](dy_rows, dsum_rows if dsum is not None else dy_rows, x_saved, weight, rstd, dx, dw_partial,
                        dy_rows.stride(0), dsum_rows.stride(0) if dsum is not None else 0,
                        n_rows, n_cols, rows_per_program, HAS_DSUM=dsum is not None, BLOCK=block,
                        num_warps=num_warps)
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x_rows = as_rows(x)
        y, _, rstd = _forward(x_rows, None, weight, eps)
        ctx.save_for_backward(x_rows if x_rows.is_contiguous() else x_rows.contiguous(), weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, None, x_rows, weight, rstd)
        return dx.view(dy.shape), dw, None


class _RMSNormResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, summed, rstd = _forward(as_rows(x), as_rows(residual), weight, eps)
        ctx.save_for_backward(summed, weight, rstd)
        return y.view(x.shape), summed.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum):
        summed, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(summed)
        dx, dw = _backward(dy, dsum, summed, weight, rstd)
        dx = dx.view(dy.shape)
        return dx, dx, dw, None


def _check(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight has shape {list(weight.shape)} but x's last dim is {x.shape[-1]}; "
                         f"pass a 1-D weight of size {x.shape[-1]}")


def _check_triton(op: str, *tensors: torch.Tensor) -> None:
    check_same_device(op, *tensors)
    for t in tensors:
        check_float_dtype(op, t)
    if tensors[0].shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {tensors[0].shape[-1]} exceeds the kernel's {MAX_HIDDEN}; "
                         "use MEGALITE_KERNEL_BACKEND=torch")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., n] with weight [n]; fp32 math, returns x.dtype."""
    _check("rms_norm", x, weight)
    if x.numel() == 0 or not use_triton(x):
        return rms_norm_reference(x, weight, eps)
    _check_triton("rms_norm", x, weight)
    return _RMSNormFunction.apply(x, weight, float(eps))


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype; both differentiable."""
    _check("rms_norm_residual", x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"rms_norm_residual: residual {list(residual.shape)} {residual.dtype} must match "
                         f"x {list(x.shape)} {x.dtype}")
    if x.numel() == 0 or not use_triton(x):
        return rms_norm_residual_reference(x, residual, weight, eps)
    _check_triton("rms_norm_residual", x, residual, weight)
    return _RMSNormResidualFunction.apply(x, residual, weight, float(eps))
