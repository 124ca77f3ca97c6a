"""Fused AdamW step (Loshchilov & Hutter 2019) over flat fp32 buffers, in place.

One pass reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (vs
about a dozen passes for the unfused torch ops). Same math, in the same order, as
torch.optim.AdamW (decoupled weight decay, bias correction, no amsgrad):

    param      *= 1 - lr * weight_decay
    exp_avg    += (1 - beta1) * (grad - exp_avg)            (torch's lerp)
    exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad^2
    param      -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)

param, exp_avg, exp_avg_sq: contiguous float32 (the sharded optimizer's master buffers);
grad: contiguous float32, bfloat16 or float16 of the same numel (read and upcast in the kernel).
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check_float_dtype, check_same_device, runnable, tl, triton, use_triton

BLOCK = 2048


def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step) -> None:
    grad = grad.float()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@triton.jit
def _adamw_kernel(PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, n_elements, decay_factor, one_minus_beta1, beta2, eps,
                  step_size, bias_correction2_sqrt, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    p = tl.load(PARAM + offs, mask=mask)
    g = tl.load(GRAD + offs, mask=mask).to(tl.float32)
    m = tl.load(EXP_AVG + offs, mask=mask)
    v = tl.load(EXP_AVG_SQ + offs, mask=mask)
    p = p * decay_factor
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + (1.0 - beta2) * (g * g)
    p = p - step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
    tl.store(PARAM + offs, p, mask=mask)
    tl.store(EXP_AVG + offs, m, mask=mask)
    tl.store(EXP_AVG_SQ + offs, v, mask=mask)


def _check(param, grad, exp_avg, exp_avg_sq, step) -> None:
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise TypeError(f"adamw_step: {name} must be a contiguous float32 buffer, got {t.dtype}"
                            f"{'' if t.is_contiguous() else ' (non-contiguous)'}")
        if t.numel() != param.numel():
            raise ValueError(f"adamw_step: {name} has {t.numel()} elements, param has {param.numel()}")
    if grad.numel() != param.numel() or not grad.is_contiguous():
        raise ValueError(f"adamw_step: grad must be contiguous with {param.numel()} elements, got {grad.numel()}")
    if step < 1:
        raise ValueError(f"adamw_step: step={step}; steps count from 1 (bias correction divides by 1 - beta^step)")


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW update of param, exp_avg, exp_avg_sq in place (torch.optim.AdamW's math).

    `step` is the 1-based count of updates including this one.
    """
    step = int(step)
    _check(param, grad, exp_avg, exp_avg_sq, step)
    if param.numel() == 0 or not use_triton(param):
        return adamw_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step)
    check_same_device("adamw_step", param, grad, exp_avg, exp_avg_sq)
    check_float_dtype("adamw_step", grad, "grad")
    runnable(_adamw_kernel, param.device)[(cdiv(param.numel(), BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, param.numel(), 1.0 - lr * weight_decay, 1.0 - beta1, beta2, eps,
        lr / (1.0 - beta1 ** step), (1.0 - beta2 ** step) ** 0.5, BLOCK=BLOCK, num_warps=8)
