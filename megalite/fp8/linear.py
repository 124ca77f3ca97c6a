"""y = x @ W^T + b with its forward, input-gradient and weight-gradient GEMMs in FP8.

Shapes: x [..., K] (K = in, or in/tp for a row-parallel layer; with `sequence_parallel` the
sequence shard [s/tp, b, K], gathered here in FP8 with its scale), W [N, K] (N = out or out/tp),
g = dL/dy [T, N] (T tokens). The three GEMMs, their contraction dim and operand layouts
(torch._scaled_mm: left row-major, right column-major):

    forward  y  [T, N] = x  [T, K] @ W^T        contract K   x_q; W_q.t()
    dgrad    dx [T, K] = g  [T, N] @ W [N, K]   contract N   g_q; (W_q^T contiguous).t()  (the transposed copy)
    wgrad    dW [N, K] = g^T [N, T] @ x [T, K]  contract T   g_q^T contiguous; (x_q^T contiguous).t()

Which scales are all-reduced over tp, so that every layout casts the numbers of the single
process (`kind` = "column": W and g sharded along N; "row": W and x sharded along K):

    tensorwise   x: unless replicated (column, no SP);  W: always;  g: column only
    rowwise      forward (along K): row only;  dgrad (along N): column only;  wgrad (along T): never

Tensorwise keeps x_q (1 byte per element) for backward; rowwise keeps x (its wgrad scales run
along T, another direction). The weight is re-cast in backward rather than held (ZeRO-3 frees
it between forward and backward).
"""
from __future__ import annotations

import torch

from megalite import comm, params as P
from megalite.fp8 import gemm
from megalite.fp8.recipe import Fp8Recipe
from megalite.fp8.scaling import quantize
from megalite.tensor_parallel.weight_grad import bypasses_autograd, route_weight_grads


def _gather_fp8(q: torch.Tensor, inv: torch.Tensor, group):
    """All-gather an FP8 sequence shard [s/tp, b, K] (as bytes: half of bf16 on the wire) and its
    scale: [] (the same on every rank) or rowwise [s/tp, b, 1] (gathered too)."""
    full = comm.all_gather(q.view(torch.uint8), group, dim=0).view(q.dtype)  # [s, b, K]
    return full, (comm.all_gather(inv, group, dim=0) if inv.dim() else inv)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, group, kind: str, sequence_parallel: bool):
        tp = comm.group_size(group) > 1
        k_group = group if (tp and kind == "row") else None
        n_group = group if (tp and kind == "column") else None
        fwd = recipe.forward_dtype
        if recipe.rowwise:
            x_q, x_inv = quantize(x, fwd, -1, k_group)  # [.., K], [.., 1]
            w_q, w_inv = quantize(weight, fwd, -1, k_group)  # [N, K], [N, 1]
            w_inv = w_inv.t()  # [1, N]
        else:
            replicated = kind == "column" and not sequence_parallel
            x_q, x_inv = quantize(x, fwd, None, None if replicated else (group if tp else None))
            w_q, w_inv = _weight_tensorwise(weight, fwd, group if tp else None)
        saved_x = x if recipe.rowwise else x_q  # the shard under SP: backward re-gathers it
        if sequence_parallel and tp:
            x_q, x_inv = _gather_fp8(x_q, x_inv, group)  # [s/tp, b, K] -> [s, b, K]
        lead = x_q.shape[:-1]
        x_q2 = x_q.reshape(-1, x_q.shape[-1])
        x_inv2 = x_inv.reshape(-1, 1) if recipe.rowwise else x_inv
        y = gemm.scaled_mm(x_q2, w_q.t(), x_inv2, w_inv, x.dtype).view(*lead, weight.shape[0])
        ctx.recipe, ctx.group, ctx.kind, ctx.sp = recipe, group, kind, sequence_parallel and tp
        ctx.k_group, ctx.n_group = k_group, n_group
        ctx.save_for_backward(saved_x, None if recipe.rowwise else x_inv, weight, bias)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, x_inv, weight, bias = ctx.saved_tensors
        recipe, needs = ctx.recipe, ctx.needs_input_grad
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [T, N]
        # tensorwise: one cast of g serves both GEMMs (rowwise casts it along N, then along T)
        g_tensorwise = None if recipe.rowwise else quantize(g2, recipe.grad_dtype, None, ctx.n_group)
        grad_input = _dgrad(ctx, g2, g_tensorwise, weight, grad_out.dtype) if needs[0] else None
        if grad_input is not None:
            grad_input = grad_input.view(*grad_out.shape[:-1], weight.shape[1])
            if ctx.sp:  # [s, b, K] partial sums over tp -> [s/tp, b, K]
                grad_input = comm.reduce_scatter(grad_input, ctx.group, dim=0)
        wants_weight, wants_bias = needs[1], bias is not None and needs[2]
        args = (ctx, g2, g_tensorwise, saved_x, x_inv, wants_weight, wants_bias)
        if bypasses_autograd(weight):
            route_weight_grads(weight, bias, _weight_grads, *args)
            return grad_input, None, None, None, None, None, None
        grad_weight, grad_bias = _weight_grads(*args)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _weight_tensorwise(weight: torch.Tensor, dtype: torch.dtype, tp_group):
    """(W_q, 1/scale): ZeRO-3's FP8-gathered copy when there is one (--fp8-param-gather), else cast here."""
    gathered = P.fp8_gathered(weight)
    return gathered if gathered is not None else quantize(weight, dtype, None, tp_group)


def _dgrad(ctx, g2: torch.Tensor, g_tensorwise, weight: torch.Tensor, out_dtype) -> torch.Tensor:
    """dx [T, K] = g [T, N] @ W [N, K], contracting N."""
    recipe = ctx.recipe
    if recipe.rowwise:
        g_q, g_inv = quantize(g2, recipe.grad_dtype, -1, ctx.n_group)  # [T, N], [T, 1]
        w_q, w_inv = quantize(weight, recipe.forward_dtype, 0, ctx.n_group)  # [N, K], [1, K]
    else:
        tp_group = ctx.group if comm.group_size(ctx.group) > 1 else None
        g_q, g_inv = g_tensorwise
        w_q, w_inv = _weight_tensorwise(weight, recipe.forward_dtype, tp_group)
    w_t = w_q.t().contiguous()  # [K, N] row-major: the transposed copy, so the right operand is column-major
    return gemm.scaled_mm(g_q, w_t.t(), g_inv, w_inv, out_dtype)


def _weight_grads(ctx, g2, g_tensorwise, saved_x, x_inv, wants_weight: bool, wants_bias: bool):
    """(dW [N, K] = g^T @ x contracting T, db [N]), each None when not wanted."""
    grad_bias = g2.sum(0) if wants_bias else None
    if not wants_weight:
        return None, grad_bias
    recipe = ctx.recipe
    if recipe.rowwise:
        x = comm.all_gather(saved_x, ctx.group, dim=0) if ctx.sp else saved_x  # [s, b, K] in the training dtype
        x2 = x.reshape(-1, x.shape[-1])
        g_q, g_inv = quantize(g2, recipe.grad_dtype, 0, None)  # [T, N], [1, N]: per output feature over T
        x_q, x_inv = quantize(x2, recipe.forward_dtype, 0, None)  # [T, K], [1, K]
        g_inv = g_inv.t()  # [N, 1]
    else:
        x_q = _gather_fp8(saved_x, x_inv, ctx.group)[0] if ctx.sp else saved_x  # re-gathered in FP8
        x_q = x_q.reshape(-1, x_q.shape[-1])
        g_q, g_inv = g_tensorwise
    a = g_q.t().contiguous()  # [N, T] row-major
    b = x_q.t().contiguous().t()  # [T, K] column-major
    return gemm.scaled_mm(a, b, g_inv, x_inv, torch.float32), grad_bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe, tp_group=None,
               kind: str = "column", sequence_parallel: bool = False) -> torch.Tensor:
    """The FP8 linear (see the module docstring); `kind` says how W is sharded over `tp_group`."""
    return _Fp8LinearFunction.apply(x, weight, bias, recipe, tp_group, kind, sequence_parallel)
