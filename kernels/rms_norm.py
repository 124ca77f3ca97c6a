"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add before it.

    y = x / sqrt(mean(x^2) + eps) * weight          over the last dim, computed in fp32

Both kernels work on [ROWS, BLOCK] tiles of rows (norm_config.py: the launch record, the
persistent backward and why). Forward: one program per tile; each row's 1/rms (`rstd`, fp32
[rows]) is saved for backward. Backward: persistent programs over contiguous row ranges write
dx and accumulate their own fp32 weight-gradient partials ([programs, n]); `column_sum` sums
those in one launch (no atomics, deterministic).

    x_hat = x * rstd;  dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy));  dw = sum_rows dy * x_hat

The statistics (mean of squares, rstd, the backward's row mean) use correctly rounded division
and square root (`tl.div_rn`, `tl.sqrt_rn`): compiled `/` and `tl.sqrt` are approximate on
NVIDIA GPUs (2 ulp), and at small variance rstd multiplies those ulps into every gradient.

The residual variant `rms_norm_residual(x, residual, weight)` returns (normed, x + residual),
the pre-norm transformer's `h = h + f(h); y = norm(h)` in one pass: the sum is rounded to
x.dtype first (exactly as `x + residual` in torch) and that rounded sum is normalised.
"""
from __future__ import annotations

import torch

from .column_sum import sum_partials
from .dispatch import as_rows, cdiv, check_float_dtype, check_same_device, new_output, next_power_of_2, runnable, tl, \
    triton, use_triton
from .norm_config import NormConfig, backward_config, backward_programs, forward_config

MAX_HIDDEN = 65536  # one row lives in registers/SRAM of one program

# Measured launch configurations (tools/tune_norms.py) keyed by BLOCK = next_power_of_2(n) on CUDA;
# a BLOCK not listed uses norm_config.default_config. NVIDIA H200, triton 3.6, 8192 rows of bf16,
# CUDA-graph timing (2026-11-26; docs/benchmarks.md).
FORWARD_CONFIGS: dict[int, NormConfig] = {
    1024: NormConfig(rows=2, num_warps=4, programs_per_sm=1),
    4096: NormConfig(rows=1, num_warps=8, programs_per_sm=1),
    8192: NormConfig(rows=1, num_warps=16, programs_per_sm=1),
}
BACKWARD_CONFIGS: dict[int, NormConfig] = {
    1024: NormConfig(rows=4, num_warps=8, programs_per_sm=2),
    4096: NormConfig(rows=1, num_warps=16, programs_per_sm=2),
    8192: NormConfig(rows=1, num_warps=16, programs_per_sm=1),
}


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def rms_norm_residual_reference(x, residual, weight, eps: float = 1e-6):
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@triton.jit
def _rms_norm_forward_kernel(X, R, SUM, Y, W, RSTD, x_row_stride, r_row_stride, n_rows, n_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * ROWS  # this tile: rows [first, first + ROWS)
    tile_rows = tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    row_mask = first + tile_rows < n_rows
    mask = row_mask & (cols < n_cols)
    out_offsets = tile_rows * n_cols + cols  # y, summed: contiguous [rows, n]; int64 base + int32 tile offsets
    x = tl.load(X + first * x_row_stride + (tile_rows * x_row_stride + cols), mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + first * r_row_stride + (tile_rows * r_row_stride + cols), mask=mask, other=0.0)
        summed = (x + r.to(tl.float32)).to(SUM.dtype.element_ty)  # round like torch's x + residual
        tl.store(SUM + first * n_cols + out_offsets, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.div_rn(tl.sum(x * x, axis=1), n_cols * 1.0)  # [ROWS]
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))[:, None]  # [ROWS, 1]
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + first * n_cols + out_offsets, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + first + tile_rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_backward_kernel(DY, DSUM, X, W, RSTD, DX, DW_PARTIAL, dy_row_stride, dsum_row_stride,
                              n_rows, n_cols, rows_per_program, HAS_DSUM: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tile_rows = tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    col_mask = cols < n_cols
    offsets = tile_rows * n_cols + cols  # x, dx: contiguous rows
    dy_offsets = tile_rows * dy_row_stride + cols
    dsum_offsets = tile_rows * dsum_row_stride + cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)  # summed over the tile's rows once, after the loop
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first in range(row_start, row_end, ROWS):  # int64 tile bases, int32 offsets inside the tile
        row_mask = first + tile_rows < row_end
        mask = row_mask & col_mask
        x = tl.load(X + first * n_cols + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + first * dy_row_stride + dy_offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + first + tile_rows, mask=row_mask, other=0.0)  # [ROWS, 1]
        x_hat = x * rstd
        w_dy = w * dy
        mean_xhat_w_dy = tl.div_rn(tl.sum(x_hat * w_dy, axis=1), n_cols * 1.0)[:, None]
        dx = (w_dy - x_hat * mean_xhat_w_dy) * rstd
        if HAS_DSUM:  # gradient flowing into the residual stream from later layers
            dx += tl.load(DSUM + first * dsum_row_stride + dsum_offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + first * n_cols + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)


def _forward_config(n_cols: int, device: torch.device) -> NormConfig:
    """The forward's tile rows and warps for rows of n_cols (tools/tune_norms.py replaces this)."""
    return forward_config(FORWARD_CONFIGS, n_cols, device)


def _backward_config(n_cols: int, device: torch.device) -> NormConfig:
    """The backward's tile rows, warps and programs per SM (tools/tune_norms.py replaces this)."""
    return backward_config(BACKWARD_CONFIGS, n_cols, device)


def _forward(x_rows, residual_rows, weight, eps):
    """x_rows, residual_rows: [rows, n] -> (y [rows, n], summed [rows, n] or None, rstd [rows] fp32)."""
    n_rows, n_cols = x_rows.shape
    config = _forward_config(n_cols, x_rows.device)
    y = new_output((n_rows, n_cols), x_rows.dtype, x_rows.device)
    rstd = new_output((n_rows,), torch.float32, x_rows.device)
    has_residual = residual_rows is not None
    summed = new_output((n_rows, n_cols), x_rows.dtype, x_rows.device) if has_residual else y
    runnable(_rms_norm_forward_kernel, x_rows.device)[(cdiv(n_rows, config.rows),)](
        x_rows, residual_rows if has_residual else x_rows, summed, y, weight, rstd, x_rows.stride(0),
        residual_rows.stride(0) if has_residual else 0, n_rows, n_cols, eps, HAS_RESIDUAL=has_residual,
        ROWS=config.rows, BLOCK=next_power_of_2(n_cols), num_warps=config.num_warps)
    return y, (summed if has_residual else None), rstd


def _backward(dy, dsum, x_saved, weight, rstd):
    """dy, dsum: [..., n]; x_saved: the normalised input [rows, n] -> (dx [rows, n], dweight [n])."""
    n_rows, n_cols = x_saved.shape
    device = x_saved.device
    dy_rows = as_rows(dy)
    dsum_rows = as_rows(dsum) if dsum is not None else None
    config = _backward_config(n_cols, device)
    programs, rows_per_program = backward_programs(config, n_rows, device)
    dx = new_output((n_rows, n_cols), x_saved.dtype, device)
    dw_partial = new_output((programs, n_cols), torch.float32, device)
    runnable(_rms_norm_backward_kernel, device)[(programs,)](
        dy_rows, dsum_rows if dsum is not None else dy_rows, x_saved, weight, rstd, dx, dw_partial,
        dy_rows.stride(0), dsum_rows.stride(0) if dsum is not None else 0, n_rows, n_cols, rows_per_program,
        HAS_DSUM=dsum is not None, ROWS=config.rows, BLOCK=next_power_of_2(n_cols), num_warps=config.num_warps)
    return dx, sum_partials(dw_partial, weight.dtype)


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
