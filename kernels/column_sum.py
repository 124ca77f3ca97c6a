"""The second pass of a two-pass column reduction: fp32 partial sums [P, n] -> [n] in one launch.

Kernels that reduce over rows (a norm's weight gradient, a bias gradient) let each of their P
programs accumulate its own rows into a row of fp32 partials, with no atomics; this kernel sums
those P rows per column in a fixed order and rounds once to the parameter's dtype. The result
is deterministic (the same bits on every run) and costs one launch, where
`partials.sum(0).to(dtype)` costs two.

    out[j] = dtype(sum_p partials[p, j])          accumulated in fp32, p in blocks of BLOCK_P
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, new_output, runnable, tl, triton

BLOCK_P, BLOCK_C = 32, 64  # a [32, 64] fp32 tile: 16 values (four 16-byte loads) per thread at 4 warps


@triton.jit
def _column_sum_kernel(PARTIALS, OUT, n_partials, n_cols, partial_row_stride, BLOCK_P: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BLOCK_C]
    tile_rows = tl.arange(0, BLOCK_P)[:, None]  # [BLOCK_P, 1]
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for first in range(0, n_partials, BLOCK_P):
        rows = first + tile_rows
        offsets = rows.to(tl.int64) * partial_row_stride + cols
        acc += tl.load(PARTIALS + offsets, mask=(rows < n_partials) & (cols < n_cols), other=0.0)
    total = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_C]
    tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=cols < n_cols)


def sum_partials(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """partials: fp32 [P, n] with unit column stride (any row stride) -> [n] of out_dtype.

    Each column summed in fp32 over the P rows in a fixed order, rounded once; no atomics.
    """
    n_partials, n_cols = partials.shape
    out = new_output((n_cols,), out_dtype, partials.device)
    runnable(_column_sum_kernel, partials.device)[(cdiv(n_cols, BLOCK_C),)](
        partials, out, n_partials, n_cols, partials.stride(0), BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C, num_warps=4)
    return out
