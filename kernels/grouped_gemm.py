"""Grouped GEMM for mixture-of-experts: every expert's tokens times that expert's weight, in one launch.

    grouped_mm(x, weight, group_sizes) -> y
        x [T, K], rows sorted by group: group g owns rows offsets[g] .. offsets[g+1]
            (offsets = exclusive cumsum of group_sizes)
        weight [E, K, N]; group_sizes int64 [E] on x's device, zeros allowed, sum == T
        y [T, N]: y[rows of g] = x[rows of g] @ weight[g]
    backward: dx[rows of g] = dy[rows of g] @ weight[g]^T      (the forward kernel on weight^T's strides)
              dweight[g]    = x[rows of g]^T @ dy[rows of g]   (zeros for a group without rows)

fp32 accumulation; y, dx and dweight in the inputs' dtype (bf16, fp16 or fp32; fp32 dots use tf32
when torch.backends.cuda.matmul.allow_tf32 does, as torch's own matmul).

Work is scheduled on the device, without reading group_sizes on the host (CUDA graphs can
capture it). The forward launches one program per (row tile, column tile) of an upper bound of
row tiles, cdiv(T, BLOCK_M) + E (each group's last tile may be partial), and each program finds
its group from `tile_offsets` (the exclusive cumsum of every group's row-tile count, made by
torch on the device): the group of row tile m is the number of groups whose tiles end at or
before m. Programs past the last real tile return at once. Row tiles never straddle two groups,
so every tile is one dense [BLOCK_M, K] x [K, BLOCK_N] product on the tensor cores, its rows
masked at the group's end; row tiles are visited group_m at a time per column sweep, so a group's
weight columns stay in L2 while its row tiles pass (the Triton matmul tutorial's ordering).
The weight gradient launches one program per (group, K tile, N tile); each loops over its
group's rows (zero iterations, and a zero tile written, for an empty group).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .dispatch import (check_float_dtype, check_same_device, new_output, next_power_of_2, runnable, tl, triton,
                       use_triton)


@dataclass(frozen=True)
class GemmTiles:
    """Block sizes of the two kernels: the forward/dx tile [block_m, block_n] stepping block_k, row tiles
    visited group_m at a time per column sweep (L2 reuse of a group's weight columns), and the
    weight-gradient tile [block_m (of K), block_n] stepping block_t rows."""
    block_m: int
    block_n: int
    block_k: int
    block_t: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# (major compute capability, 16-bit inputs?) -> tiles; compile_check holds them to no spills and
# pipelined tensor-core loops at sm_80 and sm_90. fp32 (ieee FMA or tf32) takes smaller tiles.
TILES = {
    (9, True): GemmTiles(128, 128, 64, 64, 8, 3),
    (8, True): GemmTiles(128, 128, 32, 32, 8, 4),
    (9, False): GemmTiles(64, 64, 32, 32, 4, 3),
    (8, False): GemmTiles(64, 64, 32, 32, 4, 3),
}
# small, so the interpreter (programs one by one) still sees several row tiles per group and column
# sweeps both full and partial
INTERPRETER_TILES = GemmTiles(16, 16, 16, 16, 1, 1, group_m=2)


def gemm_tiles(device: torch.device, dtype: torch.dtype) -> GemmTiles:
    if device.type != "cuda":
        return INTERPRETER_TILES
    major = min(max(torch.cuda.get_device_capability(device)[0], 8), 9)  # Blackwell takes Hopper's, Turing Ampere's
    return TILES[(major, dtype != torch.float32)]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots as torch's matmul does them (tf32 only where torch allows it); 16-bit: tensor cores."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "tf32"  # ignored for 16-bit inputs


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_mm: x must be [tokens, K] and weight [experts, K, N]; got x {list(x.shape)} "
                         f"and weight {list(weight.shape)}")
    if group_sizes.shape != (weight.shape[0],) or group_sizes.dtype != torch.int64:
        raise ValueError(f"grouped_mm: group_sizes must be int64 [experts={weight.shape[0]}]; got "
                         f"{group_sizes.dtype} {list(group_sizes.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_mm: x is {x.dtype} but weight is {weight.dtype}; cast one to the other")


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: one matmul per group in (at least) fp32 (reads the sizes on the host)."""
    _check_inputs(x, weight, group_sizes)
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    pieces = torch.split(x, group_sizes.tolist())
    out = [(piece.to(math_dtype) @ weight[g].to(math_dtype)).to(x.dtype) for g, piece in enumerate(pieces)]
    return torch.cat(out) if out else x.new_zeros(0, weight.shape[2])


@triton.jit
def _grouped_mm_kernel(X, W, Y, X_SCALE, W_SCALE, ROW_OFFSETS, TILE_OFFSETS, n_groups, k_dim, n_cols, x_stride_t,
                       w_stride_e, w_stride_k, w_stride_n, y_stride_t, w_scale_stride_e, w_scale_stride_n,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_BLOCK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, SCALED: tl.constexpr):
    """Y[rows of g] = X[rows of g] @ W[g] for one [BLOCK_M, BLOCK_N] tile. X [T, K] (unit column
    stride), W [E, K, N] by strides (W^T's for dx), Y [T, N]; offsets int32 [E + 1].
    SCALED (FP8 operands): Y[t, n] = acc[t, n] * X_SCALE[t] * W_SCALE[g, n] (fp32 inverse scales; a
    per-group scale has w_scale_stride_n 0)."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(n_cols, BLOCK_N)
    row_tiles = tl.load(TILE_OFFSETS + n_groups)  # the real count; the grid holds an upper bound
    if pid >= row_tiles * col_tiles:
        return
    sweep = GROUP_M * col_tiles
    first_row_tile = (pid // sweep) * GROUP_M
    sweep_rows = tl.minimum(row_tiles - first_row_tile, GROUP_M)
    row_tile = first_row_tile + (pid % sweep) % sweep_rows
    col_tile = (pid % sweep) // sweep_rows
    # the group owning row_tile: how many groups' tiles end at or before it
    groups = tl.arange(0, GROUP_BLOCK)
    tile_ends = tl.load(TILE_OFFSETS + 1 + groups, mask=groups < n_groups, other=2147483647)
    group = tl.sum((tile_ends <= row_tile).to(tl.int32), axis=0)
    row_start = tl.load(ROW_OFFSETS + group) + (row_tile - tl.load(TILE_OFFSETS + group)) * BLOCK_M
    row_end = tl.load(ROW_OFFSETS + group + 1)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < row_end, cols < n_cols
    x_ptrs = X + rows[:, None].to(tl.int64) * x_stride_t + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + group.to(tl.int64) * w_stride_e + ks[:, None] * w_stride_k + cols[None, :] * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
        else:
            k_mask = ks < k_dim - k
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    if SCALED:
        x_scale = tl.load(X_SCALE + rows, mask=row_mask, other=0.0)  # [BLOCK_M]
        w_scale = tl.load(W_SCALE + group * w_scale_stride_e + cols * w_scale_stride_n, mask=col_mask, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    y_ptrs = Y + rows[:, None].to(tl.int64) * y_stride_t + cols[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_mm_weight_grad_kernel(X, DY, DW, X_SCALE, DY_SCALE, ROW_OFFSETS, n_rows, k_dim, n_cols, x_stride_t, x_stride_k,
                                   dy_stride_t, dy_stride_n, dw_stride_e, dw_stride_k, x_scale_stride_e,
                                   x_scale_stride_k, dy_scale_stride_e, dy_scale_stride_n, BLOCK_K: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                   SCALED: tl.constexpr):
    """DW[g] = X[rows of g]^T @ DY[rows of g] for one [BLOCK_K, BLOCK_N] tile of one group.
    X [T, K], DY [T, N] by strides (unit column strides in 16 bits; FP8 passes the transposed
    copies, unit row strides, so both operands are contiguous along T, the contraction, as
    Hopper's FP8 tensor cores want), DW [E, K, N] (unit column stride).
    SCALED (FP8 operands): DW[g, k, n] = acc * X_SCALE[g, k] * DY_SCALE[g, n] (per-group scales:
    strides 0 along k / n)."""
    pid = tl.program_id(0)
    k_tiles, col_tiles = tl.cdiv(k_dim, BLOCK_K), tl.cdiv(n_cols, BLOCK_N)
    group = pid // (k_tiles * col_tiles)
    tile = pid % (k_tiles * col_tiles)
    ks = (tile // col_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask, col_mask = ks < k_dim, cols < n_cols
    row_start, row_end = tl.load(ROW_OFFSETS + group), tl.load(ROW_OFFSETS + group + 1)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if SCALED:
        # FP8 operands are the transposed copies, contiguous along T: loads of BLOCK_T-aligned row
        # blocks masked only at the end of the tensor (n_rows) vectorise; the rows outside the group
        # are zeroed after the load
        for t in range((row_start // BLOCK_T) * BLOCK_T, row_end, BLOCK_T):
            rows = t + tl.arange(0, BLOCK_T)
            inside = (rows >= row_start) & (rows < row_end)
            x_t = tl.load(X + rows[None, :].to(tl.int64) * x_stride_t + ks[:, None].to(tl.int64) * x_stride_k,
                          mask=k_mask[:, None] & (rows < n_rows)[None, :], other=0.0)
            dy = tl.load(DY + rows[:, None].to(tl.int64) * dy_stride_t + cols[None, :].to(tl.int64) * dy_stride_n,
                         mask=(rows < n_rows)[:, None] & col_mask[None, :], other=0.0)
            x_t = tl.where(inside[None, :], x_t, tl.zeros_like(x_t))
            dy = tl.where(inside[:, None], dy, tl.zeros_like(dy))  # (another group's inf or NaN must not leak in)
            acc = tl.dot(x_t, dy, acc)
    else:
        for t in range(row_start, row_end, BLOCK_T):
            rows = t + tl.arange(0, BLOCK_T)
            row_mask = rows < row_end
            # x^T [BLOCK_K, BLOCK_T] read straight from x's rows (its contiguous dimension is K)
            x_t = tl.load(X + rows[None, :].to(tl.int64) * x_stride_t + ks[:, None],
                          mask=k_mask[:, None] & row_mask[None, :], other=0.0)
            dy = tl.load(DY + rows[:, None].to(tl.int64) * dy_stride_t + cols[None, :],
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(x_t, dy, acc, input_precision=DOT_PRECISION)
    if SCALED:
        x_scale = tl.load(X_SCALE + group * x_scale_stride_e + ks * x_scale_stride_k, mask=k_mask, other=0.0)
        dy_scale = tl.load(DY_SCALE + group * dy_scale_stride_e + cols * dy_scale_stride_n, mask=col_mask, other=0.0)
        acc = acc * x_scale[:, None] * dy_scale[None, :]
    dw_ptrs = DW + group.to(tl.int64) * dw_stride_e + ks[:, None] * dw_stride_k + cols[None, :]
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _schedule(group_sizes: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_offsets, tile_offsets), int32 [E + 1] exclusive cumsums of rows and of row tiles per
    group: torch ops on the device, nothing read back."""
    sizes = group_sizes.to(torch.int32)
    tiles = torch.div(sizes + (block_m - 1), block_m, rounding_mode="floor")
    zero = sizes.new_zeros(1)
    row_offsets = torch.cat([zero, sizes.cumsum(0, dtype=torch.int32)])
    return row_offsets, torch.cat([zero, tiles.cumsum(0, dtype=torch.int32)])


def _launch_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, scales=None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] (unit column stride) times weight [E, K, N] (any strides: a transposed view for dx).
    FP8 operands: `scales` = (x's fp32 [T], weight's fp32 [E, N] (any strides)), output `out_dtype`."""
    tokens, k_dim = x.shape
    n_groups, _, n_cols = weight.shape
    tiles = gemm_tiles(x.device, torch.bfloat16 if scales is not None else x.dtype)  # FP8: the 16-bit tiles
    row_offsets, tile_offsets = _schedule(group_sizes, tiles.block_m)
    y = new_output((tokens, n_cols), out_dtype or x.dtype, x.device)
    x_scale, w_scale = scales if scales is not None else (y, y)  # (never read unscaled)
    row_tile_bound = triton.cdiv(tokens, tiles.block_m) + n_groups  # each group's last tile may be partial
    grid = (row_tile_bound * triton.cdiv(n_cols, tiles.block_n),)
    runnable(_grouped_mm_kernel, x.device)[grid](
        x, weight, y, x_scale, w_scale, row_offsets, tile_offsets, n_groups, k_dim, n_cols, x.stride(0),
        weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), w_scale.stride(0), w_scale.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_BLOCK=next_power_of_2(n_groups),
        GROUP_M=tiles.group_m, EVEN_K=k_dim % tiles.block_k == 0, DOT_PRECISION=dot_precision(x.dtype),
        SCALED=scales is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


def _launch_weight_grad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, scales=None) -> torch.Tensor:
    """dweight [E, K, N] from x [T, K] and dy [T, N], both with unit column strides, or (FP8) views
    of the transposed copies (unit row strides). FP8 operands: `scales` = (x's fp32 [E, K], dy's fp32
    [E, N], any strides), dweight in fp32."""
    (_, k_dim), n_cols, n_groups = x.shape, dy.shape[1], group_sizes.shape[0]
    tiles = gemm_tiles(x.device, torch.bfloat16 if scales is not None else x.dtype)
    row_offsets, _ = _schedule(group_sizes, tiles.block_m)
    dweight = new_output((n_groups, k_dim, n_cols), torch.float32 if scales is not None else x.dtype, x.device)
    x_scale, dy_scale = scales if scales is not None else (dweight, dweight)
    block_k = tiles.block_m  # the K side of the tile plays the forward's row side
    grid = (n_groups * triton.cdiv(k_dim, block_k) * triton.cdiv(n_cols, tiles.block_n),)
    runnable(_grouped_mm_weight_grad_kernel, x.device)[grid](
        x, dy, dweight, x_scale, dy_scale, row_offsets, x.shape[0], k_dim, n_cols, x.stride(0), x.stride(1), dy.stride(0),
        dy.stride(1), dweight.stride(0), dweight.stride(1), x_scale.stride(0), x_scale.stride(-1), dy_scale.stride(0), dy_scale.stride(-1),
        BLOCK_K=block_k, BLOCK_N=tiles.block_n, BLOCK_T=tiles.block_t, DOT_PRECISION=dot_precision(x.dtype),
        SCALED=scales is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return dweight


def _unit_column_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


class _GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_sizes):
        x = _unit_column_stride(x)
        ctx.save_for_backward(x, weight, group_sizes)
        return _launch_mm(x, weight, group_sizes)

    @staticmethod
    def backward(ctx, dy):
        x, weight, group_sizes = ctx.saved_tensors
        dx, dweight = _triton_grads(x, weight, group_sizes, dy, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dweight, None


def _triton_grads(x, weight, group_sizes, dy, need_dx: bool, need_dweight: bool):
    dy = _unit_column_stride(dy)
    dx = _launch_mm(dy, weight.transpose(1, 2), group_sizes) if need_dx else None
    dweight = _launch_weight_grad(_unit_column_stride(x), dy, group_sizes) if need_dweight else None
    return dx, dweight


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x [T, K] sorted by group, weight [E, K, N], group_sizes int64 [E] -> y [T, N]. See the module docstring.

    The Triton path never reads group_sizes on the host; rows past sum(group_sizes) are not written.
    """
    _check_inputs(x, weight, group_sizes)
    if min(x.shape) == 0 or weight.shape[2] == 0 or not use_triton(x):
        return grouped_mm_reference(x, weight, group_sizes)
    check_same_device("grouped_mm", x, weight, group_sizes)
    check_float_dtype("grouped_mm", x, "x")
    return _GroupedMMFunction.apply(x, weight, group_sizes)


def fp8_grouped_mm(x_q: torch.Tensor, weight_q: torch.Tensor, group_sizes: torch.Tensor, x_scale: torch.Tensor,
                   w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 operands (megalite/fp8/grouped.py): y [T, N] in out_dtype = (x_q [T, K] @ weight_q[g] [K, N], by
    strides) * x_scale [T] (per row) * w_scale [E, N] (any strides), the inverse scales on the fp32 accumulator."""
    return _launch_mm(x_q, weight_q, group_sizes, (x_scale, w_scale), out_dtype)


def fp8_grouped_mm_weight_grad(x_q: torch.Tensor, dy_q: torch.Tensor, group_sizes: torch.Tensor,
                               x_scale: torch.Tensor, dy_scale: torch.Tensor) -> torch.Tensor:
    """FP8 operands: dweight [E, K, N] fp32 = x_q[g]^T @ dy_q[g] * x_scale[g, k] * dy_scale[g, n]; x_q [T, K] and
    dy_q [T, N] are views of transposed copies (unit row strides: contiguous along T, the contraction)."""
    return _launch_weight_grad(x_q, dy_q, group_sizes, (x_scale, dy_scale))


def grouped_mm_grads(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, dy: torch.Tensor,
                     need_dx: bool = True, need_dweight: bool = True):
    """grouped_mm's backward as a plain function, for callers that keep their own autograd node
    (megalite/moe/expert_gemm.py saves the experts' weights uncopied and stacks them only here):
    dy [T, N] -> (dx [T, K] or None, dweight [E, K, N] or None), the same numbers as
    grouped_mm(x, weight, group_sizes).backward(dy) on the same path (Triton or reference)."""
    _check_inputs(x, weight, group_sizes)
    if min(x.shape) == 0 or weight.shape[2] == 0 or not use_triton(x):
        return _reference_grads(x, weight, group_sizes, dy, need_dx, need_dweight)
    return _triton_grads(x, weight, group_sizes, dy, need_dx, need_dweight)


def _reference_grads(x, weight, group_sizes, dy, need_dx: bool, need_dweight: bool):
    """What autograd computes through grouped_mm_reference: per group, in (at least) fp32."""
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    dx = grouped_mm_reference(dy, weight.transpose(1, 2), group_sizes) if need_dx else None
    if not need_dweight:
        return dx, None
    sizes = group_sizes.tolist()
    dweight = weight.new_zeros(weight.shape)  # [E, K, N]; a group without rows keeps zeros
    for g, (rows_x, rows_dy) in enumerate(zip(torch.split(x, sizes), torch.split(dy, sizes))):
        if sizes[g]:
            dweight[g] = (rows_x.to(math_dtype).t() @ rows_dy.to(math_dtype)).to(weight.dtype)
    return dx, dweight
