"""Current scaling: amax of the whole logical tensor, scale = fp8 max / amax rounded down to a power
of two (or exact), saturating cast.

A tensor sharded over tp (a weight, a row-parallel input, a sequence shard) takes its amax as a
MAX all-reduce over the tp group, so the cast is the same at every layout (layout-free):

    tensorwise  amax [] (one number): one all-reduce of 4 bytes per tensor
    rowwise     amax [rows, 1] along the contraction dim; all-reduced only when that dim is sharded

Power-of-two scales (the default, as torchao's round_scales_to_power_of_2 and the MX formats):
scale = 2^floor(log2(max / amax)). Multiplying by it is exact, so a cast rounds t itself on a
scaled FP8 grid, and an amax that moves by an ulp (a tp layout adds a row-parallel GEMM's partial
sums in another order) leaves the scale unchanged unless it crosses a power of two: with exact
scales every such ulp re-scales the whole tensor and flips the casts of values near a rounding
boundary (docs/fp8.md measures it). The price: the largest |t| * scale lies in (max/2, max], so at
most one binade of the FP8 range goes unused at the bottom (subnormals start one binade earlier).

`quantize` returns (t_q, inv_scale): t ≈ t_q * inv_scale, inv_scale being what the scaled GEMM
multiplies back in (torch._scaled_mm's scale_a / scale_b).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.kernels import fp8_cast
from megalite.kernels.dispatch import use_triton

_EPS = 1e-12  # an all-zero tensor (a fresh bias-free layer's gradient) gets scale max/1e-12, casts to 0


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def reduce_max(a: torch.Tensor, group) -> torch.Tensor:
    """a MAX-reduced over `group`: one process group, None, or a tuple of them (tp, then cp: the
    ranks holding other shards of the same logical tensor along different dims)."""
    for g in (group if isinstance(group, tuple) else (group,)):
        if comm.group_size(g) > 1:
            a = comm.all_reduce(a.contiguous(), g, op="max")
    return a


def amax(t: torch.Tensor, rowwise_dim: int | None, group=None) -> torch.Tensor:
    """fp32 amax of |t|: over everything (rowwise_dim None) -> [], or along `rowwise_dim` -> keepdim;
    MAX-reduced over `group` (the ranks holding the other shards of the same logical tensor; a
    group, None or a tuple of groups)."""
    if t.numel() == 0:  # an expert without tokens: nothing to scale, but the all-reduce is still joined
        shape = () if rowwise_dim is None else tuple(1 if d == rowwise_dim % t.dim() else n for d, n in enumerate(t.shape))
        a = torch.zeros(shape, dtype=torch.float32, device=t.device)
    else:
        a = (t.abs().amax() if rowwise_dim is None else t.abs().amax(dim=rowwise_dim, keepdim=True)).float()
    return reduce_max(a, group)


def scale_of(a: torch.Tensor, dtype: torch.dtype, pow2: bool = True) -> torch.Tensor:
    """Cast-scale (multiply before the cast) from an amax: max(dtype) / amax, rounded down to a power
    of two when `pow2` (built from the exponent bits: exact on every device)."""
    scale = fp8_max(dtype) / a.clamp(min=_EPS)
    if not pow2:
        return scale
    exponent = (scale.view(torch.int32) >> 23) & 0xFF  # biased exponent of a positive normal fp32
    return (exponent.clamp(1, 254) << 23).view(torch.float32)  # mantissa bits cleared: 2^floor(log2(scale))


def cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of t * scale (fp32 maths; float8_e4m3fn has no infinity to overflow into)."""
    limit = fp8_max(dtype)
    wide = t.float()  # a copy unless t is fp32 already: then scaled into a new tensor, else in place
    scaled = wide * scale if wide is t or wide.shape != torch.broadcast_shapes(wide.shape, scale.shape) \
        else wide.mul_(scale)  # one fp32 temporary, not two, at the grouped experts' peak (docs/fp8.md)
    return scaled.clamp_(-limit, limit).to(dtype)


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise_dim: int | None = None, group=None, pow2: bool = True):
    """(t_q in `dtype`, inv_scale fp32 [] or keepdim along rowwise_dim) with the whole-tensor scale.

    On a GPU (and with MEGALITE_KERNEL_BACKEND=triton) a contiguous tensor scaled per tensor or per
    row of its last dim is cast by kernels/fp8_cast.py (the same bits: tests/kernels/test_fp8_cast.py):
    one pass for the amax, one for the cast, instead of torch's abs, amax, multiply, clamp and cast; a
    rowwise scale that spans no other rank, one launch for both (a tensorwise scale needs the whole
    tensor's amax, all-reduced over the ranks holding it, before its first element is cast)."""
    if _kernel_applies(t, rowwise_dim):
        return _quantize_by_kernel(t, dtype, rowwise_dim is not None, group, pow2)
    scale = scale_of(amax(t, rowwise_dim, group), dtype, pow2)
    return cast(t, scale, dtype), scale.reciprocal()


def quantize_2d(t: torch.Tensor, dtype: torch.dtype, rowwise_dim: int | None = None, group=None,
                rowmajor: bool = True, transpose: bool = False, pow2: bool = True):
    """(t_q [M, K] or None, t_q^T [K, M] contiguous or None, inv_scale) of a 2-D t [M, K], scaled per
    tensor (rowwise_dim None: inv []), per row (-1 or 1: [M, 1]) or per column (0: [1, K]).

    `rowmajor` / `transpose` say which copies the caller's GEMMs read. On the Triton backend one
    cast pass writes both (kernels/fp8_cast.py); on torch the transposed copy is `t_q.t().contiguous()`,
    the same bits."""
    per_column = rowwise_dim is not None and rowwise_dim % 2 == 0
    if t.dim() == 2 and _kernel_applies(t, None) and rowwise_dim is not None and not _spans_ranks(group):
        # each line's scale from its own amax: one launch reads, scales and casts (kernels/fp8_cast.py)
        return fp8_cast.scaled_cast(t, dtype, per_column, pow2, rowmajor, transpose)
    if t.dim() == 2 and _kernel_applies(t, None):
        a = fp8_cast.column_amax(t) if per_column else fp8_cast.amax(t, rowwise_dim is not None)  # [1, K], [M, 1], []
        return _cast_by_kernel(t, a, dtype, group, rowmajor, transpose, pow2)
    q, inv = quantize(t, dtype, rowwise_dim, group, pow2)
    return (q if rowmajor else None), (q.t().contiguous() if transpose else None), inv


def _spans_ranks(group) -> bool:
    """Whether a scale's amax must be MAX-reduced over other ranks first (see reduce_max)."""
    return any(comm.group_size(g) > 1 for g in (group if isinstance(group, tuple) else (group,)))


def _cast_by_kernel(t: torch.Tensor, a: torch.Tensor, dtype: torch.dtype, group, rowmajor: bool, transpose: bool,
                    pow2: bool):
    a = reduce_max(a, group)
    scale = scale_of(a, dtype, pow2)
    q, qt = fp8_cast.cast_transpose(t, scale, dtype, transpose=transpose, rowmajor=rowmajor)
    return q, qt, scale.reciprocal()


def _kernel_applies(t: torch.Tensor, rowwise_dim: int | None) -> bool:
    last = rowwise_dim is None or rowwise_dim % t.dim() == t.dim() - 1
    return last and t.dim() >= 2 and t.numel() > 0 and t.is_contiguous() and use_triton(t)


def _quantize_by_kernel(t: torch.Tensor, dtype: torch.dtype, rowwise: bool, group, pow2: bool):
    rows = t.view(-1, t.shape[-1])  # [M, K]
    if rowwise and not _spans_ranks(group):  # each row's own amax: one launch (kernels/fp8_cast.scaled_cast)
        q, _, inv = fp8_cast.scaled_cast(rows, dtype, False, pow2)
        return q.view(t.shape), inv.view(*t.shape[:-1], 1)
    a = fp8_cast.amax(rows, rowwise)  # [] or [M, 1]
    a = reduce_max(a, group)
    scale = scale_of(a, dtype, pow2)
    q, _ = fp8_cast.cast_transpose(rows, scale, dtype, transpose=False)
    inv = scale.reciprocal()
    return q.view(t.shape), (inv.view(*t.shape[:-1], 1) if rowwise else inv)
