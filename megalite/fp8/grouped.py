"""The MoE experts' FP8 GEMMs as grouped GEMMs: every local expert's rows in one call, per-expert scales.

    fp8_grouped_mm(x [R, K], group_sizes int64 [E], weights E x [N, K], recipe, tp_group, kind) -> [R, N]

x's rows are sorted by local expert (group g owns the rows offsets[g] .. offsets[g+1]); the weights
are the parameters as stored ([out, in]). Each expert is its own logical tensor, scaled as
megalite.fp8.linear scales one linear (`kind` "column" or "row" over `tp_group`):

    tensorwise  x_g, W_g, g_g one scale each: the amaxes of all groups at once, [E], by a segment
                max on the device (scatter_reduce over the rows' group ids), MAX-reduced over tp
                where the linear's rules say so (and x_g, g_g over `tokens`, the ranks routing
                the rest of the microbatch): one all-reduce of E numbers, not E all-reduces
    rowwise     forward: x per token, W_g per output row; dgrad: g per token, W_g per input column;
                wgrad: g_g and x_g per feature over the group's tokens ([E, N], [E, K], over `tokens` too)

Every cast gives the bits the per-expert loop (one fp8_linear per expert: `per_expert_reference`
in megalite.fp8.experts) casts. The GEMMs: on the Triton backend the grouped kernels of
kernels/grouped_gemm.py with FP8 operands, the inverse scales applied to the fp32 accumulator,
and the group sizes never read on the host; on torch, one torch._scaled_mm per expert on the
operands the per-expert loop passes (the same numbers bit for bit; it reads the sizes on the
host, as the bf16 reference does).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.fp8 import gemm
from megalite.kernels import fp8_cast, grouped_gemm
from megalite.kernels.dispatch import use_triton
from megalite.fp8.recipe import Fp8Recipe
from megalite.fp8.scaling import cast, quantize_2d, reduce_max, scale_of
from megalite.parameters.weight_grad import bypasses_autograd, route_weight_grads


def _group_ids(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """[R] int64: the group of each row (no host read: the output size is given)."""
    groups = torch.arange(group_sizes.numel(), device=group_sizes.device)
    return torch.repeat_interleave(groups, group_sizes, output_size=rows)


def _segment_amax(t: torch.Tensor, gid: torch.Tensor, groups: int, per_column: bool, group=None) -> torch.Tensor:
    """fp32 amax of each group's rows of t [R, C]: [E] (tensorwise) or [E, C] (per column); MAX-reduced
    over `group`. A group without rows gets 0 (its scale then casts nothing).

    max |t| = max(max t, -min t), from t itself: no [R, C] copy of |t| (in the training dtype and
    again in fp32) at the block's peak, where --simulate found it (docs/fp8.md); the same numbers."""
    if per_column:  # maxima and minima per (group, column), with 0 included: max(hi, -lo) = max |t| (or 0)
        index = gid[:, None].expand_as(t)
        hi = torch.zeros(groups, t.shape[1], dtype=t.dtype, device=t.device).scatter_reduce_(0, index, t, "amax")
        lo = torch.zeros(groups, t.shape[1], dtype=t.dtype, device=t.device).scatter_reduce_(0, index, t, "amin")
    else:  # per row [R], then per group
        rows_hi, rows_lo = (t.amax(dim=1), t.amin(dim=1)) if t.numel() else (t.new_zeros(t.shape[0]),) * 2
        hi = torch.zeros(groups, dtype=t.dtype, device=t.device).scatter_reduce_(0, gid, rows_hi, "amax")
        lo = torch.zeros(groups, dtype=t.dtype, device=t.device).scatter_reduce_(0, gid, rows_lo, "amin")
    return reduce_max(torch.maximum(hi, -lo).float(), group)


def _cast_rows(t: torch.Tensor, scale_rows: torch.Tensor, dtype: torch.dtype, transpose: bool = False):
    """(t_q [R, C], t_q^T [C, R] contiguous or None): t cast with one scale per row [R, 1]; one pass
    of the FP8 cast kernel writes both where it runs, torch's `.t().contiguous()` else (same bits)."""
    if t.numel() and t.is_contiguous() and use_triton(t):
        return fp8_cast.cast_transpose(t, scale_rows, dtype, transpose=transpose)
    q = cast(t, scale_rows, dtype)
    return q, (q.t().contiguous() if transpose else None)


def _cast_weights(w: torch.Tensor, dtype: torch.dtype, dims, group, pow2: bool):
    """(W_q [E, N, K], inverse scales keepdim over `dims`) of the stacked weights w [E, N, K]."""
    a = w.abs().amax(dim=dims, keepdim=True).float()
    if comm.group_size(group) > 1:
        a = comm.all_reduce(a, group, op="max")
    scale = scale_of(a, dtype, pow2)
    return cast(w, scale, dtype), scale.reciprocal()


def _cast_tokens(t: torch.Tensor, gid: torch.Tensor, groups: int, dtype: torch.dtype, per_token: bool, group,
                 pow2: bool, transpose: bool = False):
    """(t_q [R, C], t_q^T [C, R] or None, inverse scales [R, 1] per token or [E] per group) of t [R, C]."""
    if per_token:  # as the FP8 linear casts per token (one kernel launch where no rank shares the rows' amaxes)
        return quantize_2d(t, dtype, -1, group, rowmajor=True, transpose=transpose, pow2=pow2)
    scale = scale_of(_segment_amax(t, gid, groups, False, group), dtype, pow2)  # [E]
    return (*_cast_rows(t, scale[gid][:, None], dtype, transpose), scale.reciprocal())


def _use_kernels(x: torch.Tensor) -> bool:
    return x.numel() > 0 and use_triton(x)


def grouped_scaled_mm(a_q, b_q, inv_a, inv_b, group_sizes, gid, out_dtype, per_token: bool):
    """out [R, N] = (a_q[rows of g] * inv_a) @ (b_q[g] * inv_b[g]) for each group g.

    a_q [R, C] row-major; b_q [E, C, N] by strides (a column-major b_q[g] is what _scaled_mm wants);
    inv_a [R, 1] (per_token) or [E]; inv_b [E, 1, N] or [E, 1, 1] (fp32)."""
    if _use_kernels(a_q):
        rows = inv_a.reshape(-1) if per_token else inv_a[gid]  # [R]
        return grouped_gemm.fp8_grouped_mm(a_q, b_q, group_sizes, rows.contiguous(),
                                           inv_b[:, 0, :].expand(-1, b_q.shape[2]), out_dtype)
    out = a_q.new_empty(a_q.shape[0], b_q.shape[2], dtype=out_dtype)
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        rows = slice(start, start + size)
        scale_a = inv_a[rows] if per_token else inv_a[g]
        scale_b = inv_b[g] if per_token else inv_b[g].reshape(())  # [1, N] or []
        out[rows] = gemm.scaled_mm(a_q[rows], b_q[g], scale_a, scale_b, out_dtype)
        start += size
    return out


def grouped_scaled_wgrad(a_t, b_t, inv_a, inv_b, group_sizes, per_feature: bool):
    """dW [E, P, Q] fp32 = (a[rows of g] * inv_a[g])^T @ (b[rows of g] * inv_b[g]) for each group, from
    the transposed copies a_t [P, R], b_t [Q, R] (contiguous along the tokens, the contraction);
    inv_a [E, P] and inv_b [E, Q] (per_feature) or [E] each."""
    groups, p, q = group_sizes.numel(), a_t.shape[0], b_t.shape[0]
    if _use_kernels(a_t):
        scales = (inv_a, inv_b) if per_feature else (inv_a[:, None].expand(-1, p), inv_b[:, None].expand(-1, q))
        return grouped_gemm.fp8_grouped_mm_weight_grad(a_t.t(), b_t.t(), group_sizes, *scales)
    out = torch.zeros(groups, p, q, dtype=torch.float32, device=a_t.device)
    start = 0
    for g, size in enumerate(group_sizes.tolist()):
        if size:  # the loop's operands: a^T row-major [P, R_g], b column-major [R_g, Q]
            a_g, b_g = a_t[:, start:start + size].contiguous(), b_t[:, start:start + size].contiguous()
            scale_a, scale_b = (inv_a[g][:, None], inv_b[g][None, :]) if per_feature else (inv_a[g], inv_b[g])
            out[g] = gemm.scaled_mm(a_g, b_g.t(), scale_a, scale_b, torch.float32)
        start += size
    return out


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_sizes, recipe: Fp8Recipe, group, kind: str, tokens, *weights):
        tp = comm.group_size(group) > 1
        ctx.tokens = tokens if comm.group_size(tokens) > 1 else None
        ctx.k_group = group if (tp and kind == "row") else None
        ctx.n_group = group if (tp and kind == "column") else None
        ctx.w_group = (ctx.k_group if recipe.rowwise else group) if tp else None
        ctx.recipe, ctx.groups = recipe, len(weights)
        gid = _group_ids(group_sizes, x.shape[0])
        fwd, pow2, rw = recipe.forward_dtype, recipe.pow2_scales, recipe.rowwise
        # x is split along K in a row layer (both recipes reduce over tp), replicated in a column layer
        # tensorwise: the same pass writes x_q^T [K, R], the weight gradient's operand, kept for backward
        # (tensorwise: and over the ranks holding the group's other tokens)
        x_q, x_t, x_inv = _cast_tokens(x, gid, len(weights), fwd, rw, ctx.k_group if rw else (ctx.k_group, ctx.tokens),
                                       pow2, transpose=not rw and any(ctx.needs_input_grad[6:]))
        w_q, w_inv = _cast_weights(torch.stack(weights), fwd, -1 if rw else (1, 2), ctx.w_group, pow2)  # [E, N, K]
        y = grouped_scaled_mm(x_q, w_q.transpose(1, 2), x_inv, w_inv.transpose(1, 2), group_sizes, gid, x.dtype, rw)
        ctx.save_for_backward(x if rw else x_t, None if rw else x_inv, group_sizes, gid, *weights)
        ctx.params = weights  # the parameters themselves: where their gradients go (bypasses_autograd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, x_inv, group_sizes, gid, *weights = ctx.saved_tensors
        recipe, needs, groups = ctx.recipe, ctx.needs_input_grad, ctx.groups
        pow2, rw = recipe.pow2_scales, recipe.rowwise
        g = grad_out.contiguous()  # [R, N]
        # tensorwise: one cast of g (per group) writes g_q for dgrad and g_q^T [N, R] for wgrad
        wants_w = any(needs[6:])
        g_group = ctx.n_group if rw else (ctx.n_group, ctx.tokens)
        g_q, g_t, g_inv = _cast_tokens(g, gid, groups, recipe.grad_dtype, rw, g_group, pow2, not rw and wants_w)
        grad_x = None
        if needs[0]:  # dx [R, K] = g @ W_g, contracting N; W's transposed copy [E, K, N] column-major
            w_q, w_inv = _cast_weights(torch.stack(weights), recipe.forward_dtype, 1 if rw else (1, 2),
                                       ctx.n_group if rw else ctx.w_group, pow2)  # inv [E, 1, K] or [E, 1, 1]
            w_t = w_q.transpose(1, 2).contiguous()  # [E, K, N]
            grad_x = grouped_scaled_mm(g_q, w_t.transpose(1, 2), g_inv, w_inv, group_sizes, gid, grad_out.dtype, rw)
        if not wants_w:
            return grad_x, None, None, None, None, None, *([None] * groups)
        if rw:  # per feature over each group's tokens: [E, N] and [E, K] scales, cast per element
            g_scale = scale_of(_segment_amax(g, gid, groups, True, ctx.tokens), recipe.grad_dtype, pow2)
            x_scale = scale_of(_segment_amax(saved_x, gid, groups, True, ctx.tokens), recipe.forward_dtype, pow2)
            g_t = cast(g, g_scale[gid], recipe.grad_dtype).t().contiguous()  # [N, R]
            x_t = cast(saved_x, x_scale[gid], recipe.forward_dtype).t().contiguous()  # [K, R]
            g_inv, x_inv = g_scale.reciprocal(), x_scale.reciprocal()
        else:
            x_t = saved_x  # [K, R], from the forward's cast
        dw = grouped_scaled_wgrad(g_t, x_t, g_inv, x_inv, group_sizes, rw)  # [E, N, K] fp32
        grads = []
        for e, weight in enumerate(ctx.params):
            if bypasses_autograd(weight):
                route_weight_grads(weight, None, lambda d=dw[e]: (d, None))
                grads.append(None)
            else:
                grads.append(dw[e].to(weight.dtype))
        return grad_x, None, None, None, None, None, *grads


def fp8_grouped_mm(x: torch.Tensor, group_sizes: torch.Tensor, weights: list[torch.Tensor], recipe: Fp8Recipe,
                   tp_group=None, kind: str = "column", tokens=None) -> torch.Tensor:
    """x [R, K] sorted by expert, group_sizes int64 [E], weights E x [N, K] -> [R, N] (module docstring).
    `tokens`: the ranks routing the other tokens of the same microbatches to these experts (the MoE
    layer's token group: cp, or tp x cp with whole experts), None when this rank has them all."""
    return _Fp8GroupedMM.apply(x, group_sizes, recipe, tp_group, kind, tokens, *weights)
