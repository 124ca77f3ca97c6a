"""FP8 casts for the FP8 linear (megalite/fp8): amax per tensor, per row or per column, and the
saturating cast that writes the FP8 tensor and/or its transposed copy in the same pass.

    amax(x [M, K], rowwise)                -> [] fp32 (tensorwise) or [M, 1] (rowwise), one read of x
    column_amax(x [M, K])                  -> [1, K] fp32, one read of x
    cast_transpose(x [M, K], scale, dtype) -> q [M, K] and/or q^T [K, M] in `dtype`, one read of x;
                                              scale [] (tensorwise), [M, 1] (per row) or [1, K] (per column)
    scaled_cast(x [M, K], dtype, per_column) -> q and/or q^T, 1/scale [M, 1] or [1, K]: rowwise in ONE
                                              launch: each program reads its lines for their amaxes,
                                              scales them and casts them (the second read from L2)

torch._scaled_mm wants its right operand column-major and its left row-major. The weight
gradient's GEMM (g^T @ x) wants g_q^T row-major and x_q column-major (= x_q^T row-major); the
input gradient's (g @ W) wants W_q column-major (= W_q^T row-major): the transposed copy comes from
the tile already in registers, so a cast costs one read and one or two writes of one byte instead
of a cast plus a transpose pass. A tensorwise scale needs the amax of the whole tensor (all-reduced
over the ranks holding its shards) before any element is cast: two launches with the reduction between
them are inherent to current scaling (delayed scaling, from earlier steps' amaxes, would avoid it). A
rowwise line's scale needs only that line: `scaled_cast`. Per-column scales (rowwise's weight gradient and W's input-gradient
cast, whose contraction dims run down the columns) are cast straight into the transposed copy,
where they are per-row scales of the GEMM operand. The scale between the two kernels is computed
(and, across tp, all-reduced) by the caller.

Rounding: round to nearest even on the FP8 grid is done here in fp32 arithmetic (the grid's
spacing from the exponent bits, the 1.5 * 2^23 trick), so the final conversion is exact. The same
bits as torch's `(x * scale).clamp(-max, max).to(float8)` therefore come out of the compiled
kernel and of Triton's CPU interpreter (whose own float8 conversion rounds twice, via float16).
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, runnable, tl, triton

BLOCK_M, BLOCK_K = 64, 64  # a [64, 64] tile: 32 fp32 values per thread at 4 warps
FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}  # mantissa, min exp, max


@triton.jit
def _amax_kernel(X, AMAX, n_rows, n_cols, x_row_stride, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Rowwise: AMAX[m] = max_k |x[m, k]|. Tensorwise: AMAX[program] = the block of rows' max (the
    caller takes the max of these partials: deterministic, no atomics)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for first in range(0, n_cols, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(X + rows.to(tl.int64) * x_row_stride + cols, mask=(rows < n_rows) & (cols < n_cols), other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    row_max = tl.max(acc, axis=1)  # [BLOCK_M]
    if ROWWISE:
        offsets = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(AMAX + offsets, row_max, mask=offsets < n_rows)
    else:
        tl.store(AMAX + tl.program_id(0), tl.max(row_max, axis=0))


@triton.jit
def _column_amax_kernel(X, AMAX, n_rows, n_cols, x_row_stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """AMAX[k] = max_m |x[m, k]|: one program per block of columns walks down all rows."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for first in range(0, n_rows, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)[:, None]
        x = tl.load(X + rows.to(tl.int64) * x_row_stride + cols, mask=(rows < n_rows) & (cols < n_cols), other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    offsets = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(AMAX + offsets, tl.max(acc, axis=0), mask=offsets < n_cols)


@triton.jit
def _cast_transpose_kernel(X, SCALE, FP8_OUT, FP8_OUT_T, n_rows, n_cols, x_row_stride, ROWWISE: tl.constexpr,
                           COLWISE: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_T: tl.constexpr, MANT: tl.constexpr,
                           MIN_EXP: tl.constexpr, LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    mask = (rows < n_rows) & (cols < n_cols)
    x = tl.load(X + rows.to(tl.int64) * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:
        scale = tl.load(SCALE + rows, mask=rows < n_rows, other=1.0)  # [BLOCK_M, 1]
    elif COLWISE:
        scale = tl.load(SCALE + cols, mask=cols < n_cols, other=1.0)  # [1, BLOCK_K]
    else:
        scale = tl.load(SCALE)
    y = tl.minimum(tl.maximum(x * scale, -LIMIT), LIMIT)
    # round to nearest even on the FP8 grid: spacing 2^(max(exponent, MIN_EXP) - MANT) (subnormals below)
    exponent = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    spacing = ((exponent - MANT + 127) << 23).to(tl.float32, bitcast=True)
    per_spacing = ((MANT - exponent + 127) << 23).to(tl.float32, bitcast=True)  # 1 / spacing: a power of two,
    # so the product is exact (a division would compile to an approximate one)
    magnitude = ((tl.abs(y) * per_spacing + 12582912.0) - 12582912.0) * spacing  # < 2^(MANT+2) steps: exact RNE
    # the sign bit: a negative that rounds to zero, and -0 itself, stay -0, as torch casts them
    y = tl.where(y.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)
    q = y.to(FP8_OUT.dtype.element_ty)
    if WRITE_Q:
        tl.store(FP8_OUT + rows.to(tl.int64) * n_cols + cols, q, mask=mask)
    if WRITE_T:
        tl.store(FP8_OUT_T + cols.to(tl.int64) * n_rows + rows, q, mask=mask)


@triton.jit
def _scaled_cast_kernel(X, SCALE, FP8_OUT, FP8_OUT_T, n_rows, n_cols, x_row_stride, COLWISE: tl.constexpr,
                        POW2: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_T: tl.constexpr, MANT: tl.constexpr,
                        MIN_EXP: tl.constexpr, LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rowwise scaling in one launch: each program owns BLOCK_M rows (COLWISE: BLOCK_K columns), walks
    them once for their amaxes, makes the scales (LIMIT / amax, to a power of two when POW2; stored in
    SCALE [M] or [K]), then walks them again to cast: the second read of the program's own lines, just
    read, comes from L2 rather than from another launch."""
    if COLWISE:
        lines = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
        n_lines, length = n_cols, n_rows
    else:
        lines = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
        n_lines, length = n_rows, n_cols
    step = BLOCK_M if COLWISE else BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for first in range(0, length, step):
        if COLWISE:
            rows, cols = first + tl.arange(0, BLOCK_M)[:, None], lines
        else:
            rows, cols = lines, first + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(X + rows.to(tl.int64) * x_row_stride + cols, mask=(rows < n_rows) & (cols < n_cols), other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    if COLWISE:
        line_amax = tl.max(acc, axis=0)[None, :]  # [1, BLOCK_K]
    else:
        line_amax = tl.max(acc, axis=1)[:, None]  # [BLOCK_M, 1]
    # as scaling.scale_of computes max / amax in torch: `max * amax.reciprocal()` (Tensor.__rtruediv__),
    # the reciprocal correctly rounded (div_rn: not the approximate division `/` would compile to)
    one = tl.full(line_amax.shape, 1.0, tl.float32)
    scale = LIMIT * tl.math.div_rn(one, tl.maximum(line_amax, 1e-12))
    if POW2:  # 2^floor(log2(scale)): the mantissa bits cleared, the exponent kept in the normal range
        exponent = tl.minimum(tl.maximum((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 254)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    tl.store(SCALE + lines, scale, mask=lines < n_lines)
    for first in range(0, length, step):
        if COLWISE:
            rows, cols = first + tl.arange(0, BLOCK_M)[:, None], lines
        else:
            rows, cols = lines, first + tl.arange(0, BLOCK_K)[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
        x = tl.load(X + rows.to(tl.int64) * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * scale, -LIMIT), LIMIT)
        # round to nearest even on the FP8 grid, as _cast_transpose_kernel (kernels call no helper of ours)
        exp = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
        spacing = ((exp - MANT + 127) << 23).to(tl.float32, bitcast=True)
        per_spacing = ((MANT - exp + 127) << 23).to(tl.float32, bitcast=True)
        magnitude = ((tl.abs(y) * per_spacing + 12582912.0) - 12582912.0) * spacing
        q = tl.where(y.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude).to(FP8_OUT.dtype.element_ty)  # -0 kept
        if WRITE_Q:
            tl.store(FP8_OUT + rows.to(tl.int64) * n_cols + cols, q, mask=mask)
        if WRITE_T:
            tl.store(FP8_OUT_T + cols.to(tl.int64) * n_rows + rows, q, mask=mask)


def amax(x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """x [M, K] (unit column stride) -> fp32 [] or [M, 1] (see the module docstring)."""
    n_rows, n_cols = x.shape
    programs = cdiv(n_rows, BLOCK_M)
    out = torch.empty(n_rows if rowwise else programs, dtype=torch.float32, device=x.device)
    runnable(_amax_kernel, x.device)[(programs,)](x, out, n_rows, n_cols, x.stride(0), ROWWISE=rowwise,
                                                  BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=4)
    return out.view(n_rows, 1) if rowwise else out.max()


def column_amax(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (unit column stride) -> fp32 [1, K], the amax of each column."""
    n_rows, n_cols = x.shape
    out = torch.empty(n_cols, dtype=torch.float32, device=x.device)
    runnable(_column_amax_kernel, x.device)[(cdiv(n_cols, BLOCK_K),)](x, out, n_rows, n_cols, x.stride(0),
                                                                     BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=4)
    return out.view(1, n_cols)


def _fp8_outputs(x: torch.Tensor, dtype: torch.dtype, rowmajor: bool, transpose: bool, caller: str):
    """(q [M, K] or None, q^T [K, M] or None): the copies a cast of x [M, K] is asked to write."""
    if not (rowmajor or transpose):
        raise ValueError(f"{caller} writes nothing: ask for the row-major copy, the transposed one or both")
    n_rows, n_cols = x.shape
    q = torch.empty(n_rows, n_cols, dtype=dtype, device=x.device) if rowmajor else None
    qt = torch.empty(n_cols, n_rows, dtype=dtype, device=x.device) if transpose else None
    return q, qt


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool = True,
                   rowmajor: bool = True):
    """(q [M, K] or None, q^T [K, M] or None): saturating round-to-nearest-even cast of x * scale,
    where scale is fp32 [] (tensorwise), [M, 1] (per row) or [1, K] (per column); `rowmajor` and
    `transpose` say which of the two copies to write."""
    n_rows, n_cols = x.shape
    mant, min_exp, limit = FORMATS[dtype]
    q, qt = _fp8_outputs(x, dtype, rowmajor, transpose, "cast_transpose")
    colwise = scale.dim() > 0 and tuple(scale.shape) == (1, n_cols)  # (M = 1 or K = 1: the same either way)
    rowwise = scale.dim() > 0 and not colwise
    grid = (cdiv(n_rows, BLOCK_M), cdiv(n_cols, BLOCK_K))
    runnable(_cast_transpose_kernel, x.device)[grid](
        x, scale.contiguous(), q if rowmajor else qt, qt if transpose else q, n_rows, n_cols, x.stride(0),
        ROWWISE=rowwise, COLWISE=colwise, WRITE_Q=rowmajor, WRITE_T=transpose, MANT=mant, MIN_EXP=min_exp,
        LIMIT=limit, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=4)
    return q, qt


ROW_TILE = (16, 256)  # scaled_cast per row: a program's 16 rows of K = 4096 bf16 are 128 KiB (L2-resident)
COLUMN_TILE = (64, 64)  # per column: the [64, 64] tile of cast_transpose (its transposed write)


def scaled_cast(x: torch.Tensor, dtype: torch.dtype, per_column: bool = False, pow2: bool = True,
                rowmajor: bool = True, transpose: bool = False):
    """(q [M, K] or None, q^T [K, M] or None, inv_scale [M, 1] or [1, K] fp32): x [M, K] (unit
    column stride) cast with one scale per row (per column when `per_column`) from that line's own
    amax, in one launch (`_scaled_cast_kernel`): for rowwise scales no other rank's amax is needed.
    The same bits as amax, scale_of and cast_transpose in three steps."""
    n_rows, n_cols = x.shape
    mant, min_exp, limit = FORMATS[dtype]
    q, qt = _fp8_outputs(x, dtype, rowmajor, transpose, "scaled_cast")
    scale = torch.empty(n_cols if per_column else n_rows, dtype=torch.float32, device=x.device)
    block_m, block_k = COLUMN_TILE if per_column else ROW_TILE
    grid = (cdiv(n_cols, block_k) if per_column else cdiv(n_rows, block_m),)
    runnable(_scaled_cast_kernel, x.device)[grid](
        x, scale, q if rowmajor else qt, qt if transpose else q, n_rows, n_cols, x.stride(0), COLWISE=per_column,
        POW2=pow2, WRITE_Q=rowmajor, WRITE_T=transpose, MANT=mant, MIN_EXP=min_exp, LIMIT=limit, BLOCK_M=block_m,
        BLOCK_K=block_k, num_warps=4)
    # the inverse by torch, on [M] or [K] numbers: bit for bit what scaling.py's torch path multiplies back
    # in (torch's CPU reciprocal is not the correctly rounded 1 / scale a kernel's div_rn would give)
    return q, qt, (scale.view(1, n_cols) if per_column else scale.view(n_rows, 1)).reciprocal()
