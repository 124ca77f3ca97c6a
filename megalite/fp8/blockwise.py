"""--fp8-recipe blockwise (DeepSeek-V3's scaling): one scale per 1 x 128 activation tile and per
128 x 128 weight block, so an outlier spoils 128 numbers, not a row or the tensor.

    GEMM     contract   left operand tiles                 right operand tiles
    forward  K          x: 1 x 128 (a token's 128 inputs)   W: 128 x 128 blocks
    dgrad    N          g: 1 x 128 (a token's 128 outputs)  W: the same blocks (one cast of W serves both)
    wgrad    T          g: 128 x 1 (a feature, 128 tokens)  x: 128 x 1 (a feature, 128 tokens)

Every scale changes along its GEMM's contraction dim (each 128), so no torch._scaled_mm computes
these: DeepSeek-V3 promotes each 128-deep partial product to fp32 and scales it there. This
reference dequantises each operand (an FP8 value times its tile's inverse scale: exact with
power-of-two scales) and multiplies in fp32: the same numbers up to fp32's summation order. A
Triton GEMM that scales per 128-deep step is the GPU path still to build (docs/fp8.md).

A tile is local to a shard only when tp shards are multiples of 128, and a 128-token tile spans
cp chunks: built for tp = 1 and cp = 1 (megalite.config.checks refuses the others in one line).
"""
from __future__ import annotations

import torch

from megalite.fp8.recipe import Fp8Recipe
from megalite.fp8.scaling import cast, scale_of
from megalite.parameters.weight_grad import bypasses_autograd, route_weight_grads

BLOCK = 128


def quantize_blocks(t: torch.Tensor, dtype: torch.dtype, rows: int, cols: int, pow2: bool = True):
    """(t_q [M, K], inverse scales [ceil(M / rows), ceil(K / cols)] fp32) of t [M, K], one scale per
    rows x cols tile (the last tiles of each dim may be partial)."""
    m, k = t.shape
    mb, kb = -(-m // rows), -(-k // cols)
    padded = t.new_zeros(mb * rows, kb * cols)  # zeros change no tile's amax
    padded[:m, :k] = t
    tiles = padded.view(mb, rows, kb, cols)
    scale = scale_of(tiles.abs().amax(dim=(1, 3)).float(), dtype, pow2)  # [mb, kb]
    q = cast(tiles, scale[:, None, :, None], dtype).view(mb * rows, kb * cols)[:m, :k].contiguous()
    return q, scale.reciprocal()


def dequantize(q: torch.Tensor, inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 [M, K]: each FP8 value times its tile's inverse scale."""
    m, k = q.shape
    return q.float() * inv.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]


class _BlockwiseLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe):
        pow2, fwd = recipe.pow2_scales, recipe.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        x_q, x_inv = quantize_blocks(x2, fwd, 1, BLOCK, pow2)
        w_q, w_inv = quantize_blocks(weight, fwd, BLOCK, BLOCK, pow2)  # [N, K]
        y = (dequantize(x_q, x_inv, 1, BLOCK) @ dequantize(w_q, w_inv, BLOCK, BLOCK).t()).to(x.dtype)
        ctx.recipe = recipe
        ctx.save_for_backward(x2, weight, bias)  # wgrad tiles x along T: cast again there
        ctx.params = (weight, bias)  # the parameters themselves: where their gradients go (bypasses_autograd)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, bias = ctx.saved_tensors
        recipe, needs = ctx.recipe, ctx.needs_input_grad
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [T, N]
        grad_input = None
        if needs[0]:  # dx [T, K] = g [T, N] @ W [N, K]
            g_q, g_inv = quantize_blocks(g2, recipe.grad_dtype, 1, BLOCK, recipe.pow2_scales)
            w_q, w_inv = quantize_blocks(weight, recipe.forward_dtype, BLOCK, BLOCK, recipe.pow2_scales)
            grad_input = (dequantize(g_q, g_inv, 1, BLOCK) @ dequantize(w_q, w_inv, BLOCK, BLOCK))
            grad_input = grad_input.to(grad_out.dtype).view(*grad_out.shape[:-1], weight.shape[1])
        args = (recipe, g2, x2, needs[1], bias is not None and needs[2])
        if bypasses_autograd(ctx.params[0]):
            route_weight_grads(*ctx.params, _weight_grads, *args)
            return grad_input, None, None, None
        grad_weight, grad_bias = _weight_grads(*args)
        return grad_input, (grad_weight.to(weight.dtype) if grad_weight is not None else None), grad_bias, None


def _weight_grads(recipe: Fp8Recipe, g2, x2, wants_weight: bool, wants_bias: bool):
    """(dW [N, K] = g^T @ x contracting T, 128 tokens per tile; db [N]), each None when not wanted."""
    grad_bias = g2.sum(0) if wants_bias else None
    if not wants_weight:
        return None, grad_bias
    g_q, g_inv = quantize_blocks(g2, recipe.grad_dtype, BLOCK, 1, recipe.pow2_scales)  # [T, N]
    x_q, x_inv = quantize_blocks(x2, recipe.forward_dtype, BLOCK, 1, recipe.pow2_scales)  # [T, K]
    return dequantize(g_q, g_inv, BLOCK, 1).t() @ dequantize(x_q, x_inv, BLOCK, 1), grad_bias


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: Fp8Recipe) -> torch.Tensor:
    """y = x @ W^T + b with blockwise-scaled FP8 GEMMs (module docstring); x [..., K], W [N, K]."""
    return _BlockwiseLinearFunction.apply(x, weight, bias, recipe)
