"""y = x @ W^T + b with its forward, input-gradient and weight-gradient GEMMs in FP8.

Shapes: x [..., K] (K = in, or in/tp for a row-parallel layer; with `sequence_parallel` the
sequence shard [s/tp, b, K], gathered here in FP8 with its scale), W [N, K] (N = out or out/tp),
g = dL/dy [T, N] (T tokens). The three GEMMs, their contraction dim and operand layouts
(torch._scaled_mm: left row-major, right column-major):

    forward  y  [T, N] = x  [T, K] @ W^T        contract K   x_q; W_q.t()
    dgrad    dx [T, K] = g  [T, N] @ W [N, K]   contract N   g_q; W_q^T.t()
    wgrad    dW [N, K] = g^T [N, T] @ x [T, K]  contract T   g_q^T; x_q^T.t()

X_q^T are the transposed copies [K, N], [N, T], [K, T], contiguous: each comes out of the same cast
pass as its tensor's row-major copy (kernels/fp8_cast.py on the Triton backend, `.t().contiguous()`
of the same bits on torch). Tensorwise casts x once for forward and wgrad, and g once for dgrad
and wgrad.

Which scales are all-reduced over tp, so that every layout casts the numbers of the single
process (`kind` = "column": W and g sharded along N; "row": W and x sharded along K):

    tensorwise   x: unless replicated (column, no SP);  W: always;  g: column only
    rowwise      forward (along K): row only;  dgrad (along N): column only;  wgrad (along T): never

and under context parallelism (`tokens`, the cp group: x and g hold s/cp of each sequence's
tokens) also over cp: tensorwise x and g, rowwise's wgrad scales (along T); W never.

Tensorwise keeps x_q^T (1 byte per element; the FP8 shard x_q under SP) for backward; rowwise keeps x (its wgrad scales run
along T, another direction). The weight is re-cast in backward rather than held (ZeRO-3 frees
it between forward and backward).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.fp8 import gemm
from megalite.fp8.blockwise import blockwise_linear
from megalite.fp8.recipe import Fp8Recipe
from megalite.fp8.scaling import quantize, quantize_2d
from megalite.parameters.weight_grad import bypasses_autograd, route_weight_grads


def _gather_fp8(q: torch.Tensor, inv: torch.Tensor, group):
    """All-gather an FP8 sequence shard [s/tp, b, K] (as bytes: half of bf16 on the wire) and its
    scale: [] (the same on every rank) or rowwise [s/tp, b, 1] (gathered too)."""
    full = comm.all_gather(q.view(torch.uint8), group, dim=0).view(q.dtype)  # [s, b, K]
    return full, (comm.all_gather(inv, group, dim=0) if inv.dim() else inv)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, group, kind: str, sequence_parallel: bool, tokens=None):
        tp = comm.group_size(group) > 1
        ctx.tokens = tokens if comm.group_size(tokens) > 1 else None  # cp: the ranks holding the other tokens
        k_group = group if (tp and kind == "row") else None
        n_group = group if (tp and kind == "column") else None
        sp = sequence_parallel and tp
        fwd, pow2 = recipe.forward_dtype, recipe.pow2_scales
        if recipe.rowwise:
            x_q, x_inv = quantize(x, fwd, -1, k_group, pow2)  # [.., K], [.., 1]
            w_q, w_inv = quantize(weight, fwd, -1, k_group, pow2)  # [N, K], [N, 1]
            w_inv = w_inv.t()  # [1, N]
            saved_x = x  # its wgrad scales run along T: cast again in backward
        else:
            replicated = kind == "column" and not sequence_parallel
            x_group = (None if replicated else (group if tp else None), ctx.tokens)
            # one cast writes x_q [T, K] for this GEMM and, unless SP re-gathers the shard in backward,
            # x_q^T [K, T], the weight gradient's right operand: what backward keeps (1 byte per element)
            x2 = x.reshape(-1, x.shape[-1])
            x_q, saved_x, x_inv = quantize_2d(x2, fwd, None, x_group, transpose=not sp and ctx.needs_input_grad[1],
                                              pow2=pow2)
            x_q = x_q.view(x.shape)
            w_q, w_inv = _weight_tensorwise(weight, fwd, group if tp else None, pow2)
            if sp:
                saved_x = x_q  # the shard [s/tp, b, K]: backward re-gathers it in FP8
        if sp:
            x_q, x_inv = _gather_fp8(x_q, x_inv, group)  # [s/tp, b, K] -> [s, b, K]
        lead = x_q.shape[:-1]
        x_q2 = x_q.reshape(-1, x_q.shape[-1])
        x_inv2 = x_inv.reshape(-1, 1) if recipe.rowwise else x_inv
        y = gemm.scaled_mm(x_q2, w_q.t(), x_inv2, w_inv, x.dtype).view(*lead, weight.shape[0])
        ctx.recipe, ctx.group, ctx.kind, ctx.sp = recipe, group, kind, sp
        # the parameter itself: a saved-tensor hook (activation offloading, --simulate's memory count)
        # hands backward another Python object for it, without ZeRO-3's gathered FP8 copy
        ctx.parameter, ctx.bias = weight, bias  # routing and the gathered copy: bypasses_autograd
        ctx.k_group, ctx.n_group = k_group, n_group
        ctx.save_for_backward(saved_x, None if recipe.rowwise else x_inv, weight, bias)
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, x_inv, weight, bias = ctx.saved_tensors
        recipe, needs = ctx.recipe, ctx.needs_input_grad
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [T, N]
        # tensorwise: one cast of g writes g_q [T, N] for dgrad and g_q^T [N, T] for wgrad (rowwise
        # casts it along N, then along T)
        g_tensorwise = None
        if not recipe.rowwise and (needs[0] or needs[1]):
            g_tensorwise = quantize_2d(g2, recipe.grad_dtype, None, (ctx.n_group, ctx.tokens), rowmajor=needs[0],
                                       transpose=needs[1],
                                       pow2=recipe.pow2_scales)
        grad_input = _dgrad(ctx, g2, g_tensorwise, weight, grad_out.dtype) if needs[0] else None
        if grad_input is not None:
            grad_input = grad_input.view(*grad_out.shape[:-1], weight.shape[1])
            if ctx.sp:  # [s, b, K] partial sums over tp -> [s/tp, b, K]
                grad_input = comm.reduce_scatter(grad_input, ctx.group, dim=0)
        wants_weight, wants_bias = needs[1], bias is not None and needs[2]
        args = (ctx, g2, g_tensorwise, saved_x, x_inv, wants_weight, wants_bias)
        if bypasses_autograd(ctx.parameter):
            route_weight_grads(ctx.parameter, ctx.bias, _weight_grads, *args)
            return grad_input, None, None, None, None, None, None, None
        grad_weight, grad_bias = _weight_grads(*args)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _weight_tensorwise(weight: torch.Tensor, dtype: torch.dtype, tp_group, pow2: bool):
    """(W_q, 1/scale): ZeRO-3's FP8-gathered copy when there is one (--fp8-param-gather), else cast here."""
    gathered = P.fp8_gathered(weight)
    return gathered if gathered is not None else quantize(weight, dtype, None, tp_group, pow2)


def _dgrad(ctx, g2: torch.Tensor, g_tensorwise, weight: torch.Tensor, out_dtype) -> torch.Tensor:
    """dx [T, K] = g [T, N] @ W [N, K], contracting N: W's cast writes only its transposed copy
    W_q^T [K, N] (the right operand, column-major)."""
    recipe = ctx.recipe
    if recipe.rowwise:
        g_q, g_inv = quantize(g2, recipe.grad_dtype, -1, ctx.n_group, recipe.pow2_scales)  # [T, N], [T, 1]
        _, w_t, w_inv = quantize_2d(weight, recipe.forward_dtype, 0, ctx.n_group, rowmajor=False,
                                    transpose=True, pow2=recipe.pow2_scales)  # [K, N], [1, K]
    else:
        tp_group = ctx.group if comm.group_size(ctx.group) > 1 else None
        g_q, _, g_inv = g_tensorwise
        gathered = P.fp8_gathered(ctx.parameter)  # --fp8-param-gather: ZeRO-3 gathered W_q, nothing to cast
        if gathered is not None:
            w_t, w_inv = gathered[0].t().contiguous(), gathered[1]
        else:
            _, w_t, w_inv = quantize_2d(weight, recipe.forward_dtype, None, tp_group, rowmajor=False, transpose=True,
                                        pow2=recipe.pow2_scales)
    return gemm.scaled_mm(g_q, w_t.t(), g_inv, w_inv, out_dtype)


def _weight_grads(ctx, g2, g_tensorwise, saved_x, x_inv, wants_weight: bool, wants_bias: bool):
    """(dW [N, K] = g^T @ x contracting T, db [N]), each None when not wanted. Operands: g_q^T [N, T]
    row-major and x_q^T [K, T] row-major (x_q column-major), both transposed copies from their casts."""
    grad_bias = g2.sum(0) if wants_bias else None
    if not wants_weight:
        return None, grad_bias
    recipe = ctx.recipe
    if recipe.rowwise:
        x = comm.all_gather(saved_x, ctx.group, dim=0) if ctx.sp else saved_x  # [s, b, K] in the training dtype
        x2 = x.reshape(-1, x.shape[-1])
        # per feature over T: per-column scales, cast straight into the transposed copies
        _, g_t, g_inv = quantize_2d(g2, recipe.grad_dtype, 0, ctx.tokens, False, True, recipe.pow2_scales)  # [N, T], [1, N]
        _, x_t, x_inv = quantize_2d(x2, recipe.forward_dtype, 0, ctx.tokens, False, True, recipe.pow2_scales)  # [K, T], [1, K]
        g_inv = g_inv.t()  # [N, 1]
    elif ctx.sp:  # re-gathered in FP8; the gathered copy is transposed here (no cast to fuse it with)
        x_q = _gather_fp8(saved_x, x_inv, ctx.group)[0]  # [s, b, K]
        x_t = x_q.reshape(-1, x_q.shape[-1]).t().contiguous()  # [K, T]
        _, g_t, g_inv = g_tensorwise
    else:
        x_t = saved_x  # [K, T], written by the forward's cast
        _, g_t, g_inv = g_tensorwise
    return gemm.scaled_mm(g_t, x_t.t(), g_inv, x_inv, torch.float32), grad_bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe, tp_group=None,
               kind: str = "column", sequence_parallel: bool = False, tokens=None) -> torch.Tensor:
    """The FP8 linear (see the module docstring); `kind` says how W is sharded over `tp_group`;
    `tokens`: the group holding the other tokens of x's sequences (cp), None without cp."""
    if recipe.blockwise:  # tp = cp = 1 (megalite.config.checks): its tiles need no amax reduction
        if comm.group_size(tp_group) > 1 or comm.group_size(tokens) > 1:
            raise ValueError("--fp8-recipe blockwise is built for --tp 1 and --cp 1")
        return blockwise_linear(x, weight, bias, recipe)
    return _Fp8LinearFunction.apply(x, weight, bias, recipe, tp_group, kind, sequence_parallel, tokens)
