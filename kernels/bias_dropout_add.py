"""Fused bias + dropout + residual add: out = residual + dropout(x + bias), the transformer
block's `x + dropout(proj(...) + bias)` in one pass, keeping nothing for backward.

    keep_i = philox(seed, offset + i) >= drop_threshold(p)     (kernels/philox.py)
    out_i  = residual_i + (keep_i ? (x_i + bias_{i % n}) / (1 - p) : 0)

Element i is the i-th element of x in row-major order, so a caller holding a contiguous slice
of a larger logical tensor (a sequence shard under sequence parallelism) passes the slice's
first index as `offset` and gets exactly its part of the whole tensor's mask. fp32 math,
rounded once to x.dtype. Backward regenerates the mask from (seed, offset): 0 bytes kept
(Megatron keeps a 1-byte mask per element):

    d_residual = dout;   dx = keep ? dout / (1 - p) : 0;   dbias = sum over rows of the fp32 dx

dbias sums the fp32 products before dx is rounded to x.dtype, as the definition does: summing
the rounded dx would add up one rounding error per element (at p = 0.6, dout * 2.5 rounds in
most elements). With a bias gradient the backward kernel works on [BLOCK_R, BLOCK_C] tiles,
writes dx and keeps per-program fp32 column sums [programs, n] that `column_sum` reduces.

bias and residual are optional (plain dropout: both None); p = 0 is the fused bias-residual add.
"""
from __future__ import annotations

import torch

from .column_sum import sum_partials
from .dispatch import cdiv, check_float_dtype, check_same_device, new_output, next_power_of_2, num_programs_hint, \
    runnable, tl, triton, use_triton
from .philox import drop_threshold, keep_mask

BLOCK = 1024
# dx and bias-gradient tiles: [BLOCK_R, up to 256] columns of one row stay contiguous (512 bytes in
# 16-bit), 1024 elements per tile at 4 warps: 8 Philox states per thread, as the dx-only kernel
BIAS_GRAD_BLOCK_C, BIAS_GRAD_TILE = 256, 1024


def bias_dropout_add_reference(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                               p: float = 0.0, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The definition in plain differentiable PyTorch (it keeps the mask; the op below does not)."""
    value = x.float() if bias is None else x.float() + bias.float()
    if p > 0.0:
        keep = keep_mask(seed, offset, x.shape, p, x.device)
        value = torch.where(keep, value * (1.0 / (1.0 - p)), 0.0)
    if residual is not None:
        value = residual.float() + value
    return value.to(x.dtype)


@triton.jit(do_not_specialize=["seed", "offset", "threshold"])
def _bias_dropout_add_forward_kernel(X, BIAS, RESIDUAL, OUT, n_elements, n_cols, seed, offset, threshold, dropout_scale,
                                     HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                                     BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    value = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        value = value + tl.load(BIAS + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = tl.randint(seed, offset + offs).to(tl.int64) >= threshold
        value = tl.where(keep, value * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        value = tl.load(RESIDUAL + offs, mask=mask, other=0.0).to(tl.float32) + value
    tl.store(OUT + offs, value.to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset", "threshold"])
def _dropout_backward_kernel(DOUT, DX, n_elements, seed, offset, threshold, dropout_scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    keep = tl.randint(seed, offset + offs).to(tl.int64) >= threshold
    tl.store(DX + offs, tl.where(keep, dout * dropout_scale, 0.0).to(DX.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset", "threshold"])
def _dropout_bias_backward_kernel(DOUT, DX, PARTIALS, n_rows, n_cols, rows_per_program, seed, offset, threshold,
                                  dropout_scale, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (c, g): columns [c*BLOCK_C, +BLOCK_C) of rows [g*rows_per_program, +rows_per_program)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    group = tl.program_id(1)
    tile_rows = tl.arange(0, BLOCK_R)[:, None]  # [BLOCK_R, 1]
    col_mask = cols < n_cols
    row_start = group.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    column_sums = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for first in range(row_start, row_end, BLOCK_R):
        index = (first + tile_rows) * n_cols + cols  # int64 [BLOCK_R, BLOCK_C]: element index in x
        mask = (first + tile_rows < row_end) & col_mask
        dout = tl.load(DOUT + index, mask=mask, other=0.0).to(tl.float32)
        keep = tl.randint(seed, offset + index).to(tl.int64) >= threshold
        grad = tl.where(keep, dout * dropout_scale, 0.0)  # fp32, before rounding: what dbias sums
        tl.store(DX + index, grad.to(DX.dtype.element_ty), mask=mask)
        column_sums += grad
    tl.store(PARTIALS + group * n_cols + cols, tl.sum(column_sums, axis=0)[None, :], mask=col_mask)


def _forward(x, bias, residual, p, seed, offset, kernel: bool) -> torch.Tensor:
    if not kernel:
        with torch.no_grad():
            return bias_dropout_add_reference(x, bias, residual, p, seed, offset)
    out = new_output(x.shape, x.dtype, x.device)
    runnable(_bias_dropout_add_forward_kernel, x.device)[(cdiv(x.numel(), BLOCK),)](
        x, x if bias is None else bias, x if residual is None else residual, out, x.numel(), x.shape[-1], seed,
        offset, drop_threshold(p), 1.0 / (1.0 - p), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_DROPOUT=p > 0.0, BLOCK=BLOCK, num_warps=4)
    return out


def _dropout_backward(dout, p, seed, offset, kernel: bool) -> torch.Tensor:
    """dout (contiguous) -> dx = keep ? dout / (1 - p) : 0, rounded to dout.dtype (p > 0)."""
    if not kernel:
        keep = keep_mask(seed, offset, dout.shape, p, dout.device)
        return torch.where(keep, dout.float() * (1.0 / (1.0 - p)), 0.0).to(dout.dtype)
    dx = new_output(dout.shape, dout.dtype, dout.device)
    runnable(_dropout_backward_kernel, dout.device)[(cdiv(dout.numel(), BLOCK),)](
        dout, dx, dout.numel(), seed, offset, drop_threshold(p), 1.0 / (1.0 - p), BLOCK=BLOCK, num_warps=4)
    return dx


def _dropout_bias_backward(dout, p, seed, offset, bias_dtype, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dout (contiguous [..., n]) -> (dx, dbias [n] of bias_dtype), p > 0: dbias sums the fp32 dx."""
    n_cols = dout.shape[-1]
    if not kernel:
        keep = keep_mask(seed, offset, dout.shape, p, dout.device)
        grad = torch.where(keep, dout.float() * (1.0 / (1.0 - p)), 0.0)
        return grad.to(dout.dtype), grad.reshape(-1, n_cols).sum(0).to(bias_dtype)
    n_rows = dout.numel() // n_cols
    block_c = min(BIAS_GRAD_BLOCK_C, next_power_of_2(n_cols))
    block_r = BIAS_GRAD_TILE // block_c
    column_blocks = cdiv(n_cols, block_c)
    # row groups: about num_programs_hint programs in all, each a whole number of row tiles
    groups = max(1, min(cdiv(n_rows, block_r), num_programs_hint(dout.device) // column_blocks))
    rows_per_program = cdiv(cdiv(n_rows, groups), block_r) * block_r
    groups = cdiv(n_rows, rows_per_program)
    dx = new_output(dout.shape, dout.dtype, dout.device)
    partials = new_output((groups, n_cols), torch.float32, dout.device)
    runnable(_dropout_bias_backward_kernel, dout.device)[(column_blocks, groups)](
        dout, dx, partials, n_rows, n_cols, rows_per_program, seed, offset, drop_threshold(p), 1.0 / (1.0 - p),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return dx, sum_partials(partials, bias_dtype)


class _BiasDropoutAddFunction(torch.autograd.Function):
    """Saves only Python numbers: (p, seed, offset) regenerate the mask in backward."""

    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, offset, kernel):
        ctx.p, ctx.seed, ctx.offset, ctx.kernel = p, seed, offset, kernel
        ctx.has_bias, ctx.bias_dtype = bias is not None, bias.dtype if bias is not None else None
        return _forward(x, bias, residual, p, seed, offset, kernel)

    @staticmethod
    def backward(ctx, dout):
        dout = dout.contiguous()
        dx = dbias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            if ctx.p > 0.0:
                dx, dbias = _dropout_bias_backward(dout, ctx.p, ctx.seed, ctx.offset, ctx.bias_dtype, ctx.kernel)
            else:  # dx = dout: its rows summed in fp32 and rounded once, in one launch
                dx, dbias = dout, dout.reshape(-1, dout.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        elif ctx.needs_input_grad[0]:
            dx = _dropout_backward(dout, ctx.p, ctx.seed, ctx.offset, ctx.kernel) if ctx.p > 0.0 else dout
        dresidual = dout if ctx.needs_input_grad[2] else None
        return (dx if ctx.needs_input_grad[0] else None), dbias, dresidual, None, None, None, None


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                     p: float = 0.0, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """residual + dropout(x + bias) with the mask of Philox (seed, offset + i); see the module doc.

    x [..., n]; bias [n] or None; residual like x or None; 0 <= p < 1; seed in [0, 2^63);
    offset >= 0: the Philox counter of x's first element.
    """
    drop_threshold(p)  # raises on p outside [0, 1)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"bias_dropout_add: bias has shape {list(bias.shape)} but x's last dim is {x.shape[-1]}; "
                         f"pass a 1-D bias of size {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual shape {list(residual.shape)} differs from x's {list(x.shape)}")
    if not 0 <= seed < 2 ** 63 or offset < 0:
        raise ValueError(f"bias_dropout_add: seed must be in [0, 2^63) and offset >= 0, got {seed}, {offset}")
    if p == 0.0 and bias is None and residual is None:
        return x
    kernel = x.numel() > 0 and use_triton(x)
    if kernel:
        tensors = [t for t in (x, bias, residual) if t is not None]
        check_same_device("bias_dropout_add", *tensors)
        for name, t in zip(("x", "bias", "residual"), (x, bias, residual)):
            if t is not None:
                check_float_dtype("bias_dropout_add", t, name)
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    return _BiasDropoutAddFunction.apply(x, bias, residual, float(p), int(seed), int(offset), kernel)
