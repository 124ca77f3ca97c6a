"""LayerNorm (Ba et al. 2016), optionally fused with the residual add before it.

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      over the last dim, fp32 math

Same structure as rms_norm.py: [ROWS, BLOCK] tiles (norm_config.py); forward one program per
tile saving mean and rstd (fp32 [rows]); backward persistent programs over row ranges, each
writing dx and fp32 partial weight and bias gradients side by side in one [programs, 2n]
buffer that `column_sum` reduces in one launch. Statistics use correctly rounded division and
square root (see rms_norm.py).

    x_hat = (x - mean) * rstd
    dx = rstd * (w*dy - mean(w*dy) - x_hat * mean(x_hat * w*dy));  dw = sum dy*x_hat;  db = sum dy

`layer_norm_residual(x, residual, weight, bias)` returns (layer_norm(x + residual), x + residual)
with the sum rounded to x.dtype first, like `x + residual` in torch.
"""
from __future__ import annotations

import torch

from .column_sum import sum_partials
from .dispatch import as_rows, cdiv, new_output, next_power_of_2, runnable, tl, triton, use_triton
from .norm_config import NormConfig, backward_config, backward_programs, forward_config
from .rms_norm import _check, _check_triton

# Measured launch configurations (tools/tune_norms.py) keyed by BLOCK = next_power_of_2(n) on CUDA;
# a BLOCK not listed uses norm_config.default_config. NVIDIA H200, triton 3.6, 8192 rows of bf16,
# CUDA-graph timing (2026-11-26; docs/benchmarks.md).
FORWARD_CONFIGS: dict[int, NormConfig] = {
    1024: NormConfig(rows=2, num_warps=4, programs_per_sm=1),
    4096: NormConfig(rows=2, num_warps=8, programs_per_sm=1),
    8192: NormConfig(rows=2, num_warps=16, programs_per_sm=1),
}
BACKWARD_CONFIGS: dict[int, NormConfig] = {
    1024: NormConfig(rows=2, num_warps=4, programs_per_sm=4),
    4096: NormConfig(rows=1, num_warps=8, programs_per_sm=2),
    8192: NormConfig(rows=1, num_warps=16, programs_per_sm=1),
}


def layer_norm_reference(x, weight, bias, eps: float = 1e-5):
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def layer_norm_residual_reference(x, residual, weight, bias, eps: float = 1e-5):
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps), summed


@triton.jit
def _layer_norm_forward_kernel(X, R, SUM, Y, W, B, MEAN, RSTD, x_row_stride, r_row_stride, n_rows, n_cols, eps,
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
    mean = tl.div_rn(tl.sum(x, axis=1), n_cols * 1.0)[:, None]  # [ROWS, 1]
    centered = tl.where(mask, x - mean, 0.0)
    variance = tl.div_rn(tl.sum(centered * centered, axis=1), n_cols * 1.0)  # [ROWS]
    rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))[:, None]  # [ROWS, 1]
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + first * n_cols + out_offsets, (centered * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + first + tile_rows, mean, mask=row_mask)
    tl.store(RSTD + first + tile_rows, rstd, mask=row_mask)


@triton.jit
def _layer_norm_backward_kernel(DY, DSUM, X, W, MEAN, RSTD, DX, PARTIALS, dy_row_stride, dsum_row_stride, n_rows,
                                n_cols, rows_per_program, HAS_DSUM: tl.constexpr, ROWS: tl.constexpr,
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
    db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first in range(row_start, row_end, ROWS):  # int64 tile bases, int32 offsets inside the tile
        row_mask = first + tile_rows < row_end
        mask = row_mask & col_mask
        x = tl.load(X + first * n_cols + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + first * dy_row_stride + dy_offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + first + tile_rows, mask=row_mask, other=0.0)  # [ROWS, 1]
        rstd = tl.load(RSTD + first + tile_rows, mask=row_mask, other=0.0)
        x_hat = (x - mean) * rstd  # padding columns: w*dy = dy = 0 there, so they add nothing below
        w_dy = w * dy
        mean_w_dy = tl.div_rn(tl.sum(w_dy, axis=1), n_cols * 1.0)[:, None]
        mean_xhat_w_dy = tl.div_rn(tl.sum(x_hat * w_dy, axis=1), n_cols * 1.0)[:, None]
        dx = (w_dy - mean_w_dy - x_hat * mean_xhat_w_dy) * rstd
        if HAS_DSUM:  # gradient flowing into the residual stream from later layers
            dx += tl.load(DSUM + first * dsum_row_stride + dsum_offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + first * n_cols + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    # partials row pid: [dw (n) | db (n)]
    tl.store(PARTIALS + pid * 2 * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)
    tl.store(PARTIALS + pid * 2 * n_cols + n_cols + cols, tl.sum(db, axis=0)[None, :], mask=col_mask)


def _forward_config(n_cols: int, device: torch.device) -> NormConfig:
    """The forward's tile rows and warps for rows of n_cols (tools/tune_norms.py replaces this)."""
    return forward_config(FORWARD_CONFIGS, n_cols, device)


def _backward_config(n_cols: int, device: torch.device) -> NormConfig:
    """The backward's tile rows, warps and programs per SM (tools/tune_norms.py replaces this)."""
    return backward_config(BACKWARD_CONFIGS, n_cols, device)


def _forward(x_rows, residual_rows, weight, bias, eps):
    """x_rows, residual_rows: [rows, n] -> (y, summed or None, mean [rows] fp32, rstd [rows] fp32)."""
    n_rows, n_cols = x_rows.shape
    device = x_rows.device
    config = _forward_config(n_cols, device)
    y = new_output((n_rows, n_cols), x_rows.dtype, device)
    mean = new_output((n_rows,), torch.float32, device)
    rstd = new_output((n_rows,), torch.float32, device)
    has_residual = residual_rows is not None
    summed = new_output((n_rows, n_cols), x_rows.dtype, device) if has_residual else y
    runnable(_layer_norm_forward_kernel, device)[(cdiv(n_rows, config.rows),)](
        x_rows, residual_rows if has_residual else x_rows, summed, y, weight, bias, mean, rstd,
        x_rows.stride(0), residual_rows.stride(0) if has_residual else 0, n_rows, n_cols, eps,
        HAS_RESIDUAL=has_residual, ROWS=config.rows, BLOCK=next_power_of_2(n_cols), num_warps=config.num_warps)
    return y, (summed if has_residual else None), mean, rstd


def _backward(dy, dsum, x_saved, weight, bias, mean, rstd):
    """dy, dsum: [..., n]; x_saved: the normalised input [rows, n] -> (dx [rows, n], dweight, dbias)."""
    n_rows, n_cols = x_saved.shape
    device = x_saved.device
    dy_rows = as_rows(dy)
    dsum_rows = as_rows(dsum) if dsum is not None else None
    config = _backward_config(n_cols, device)
    programs, rows_per_program = backward_programs(config, n_rows, device)
    dx = new_output((n_rows, n_cols), x_saved.dtype, device)
    partials = new_output((programs, 2 * n_cols), torch.float32, device)  # [programs, dw | db]
    runnable(_layer_norm_backward_kernel, device)[(programs,)](
        dy_rows, dsum_rows if dsum is not None else dy_rows, x_saved, weight, mean, rstd, dx, partials,
        dy_rows.stride(0), dsum_rows.stride(0) if dsum is not None else 0, n_rows, n_cols, rows_per_program,
        HAS_DSUM=dsum is not None, ROWS=config.rows, BLOCK=next_power_of_2(n_cols), num_warps=config.num_warps)
    if weight.dtype == bias.dtype:  # both gradients from one launch: [2n] -> views [n], [n]
        grads = sum_partials(partials, weight.dtype)
        return dx, grads[:n_cols], grads[n_cols:]
    return dx, sum_partials(partials[:, :n_cols], weight.dtype), sum_partials(partials[:, n_cols:], bias.dtype)


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
