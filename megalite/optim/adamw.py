"""AdamW's arithmetic on flat fp32 tensors: the update DistributedOptimizer applies to each run of its shard."""
from __future__ import annotations

import math

import torch

from megalite.kernels.adamw import adamw_step as fused_adamw_step


def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 *, lr: float, beta1: float, beta2: float, eps: float, step: int) -> None:
    """One AdamW update of flat fp32 tensors in place (weight decay applied by the caller).

    Same operation order as torch.optim.AdamW's single-tensor path, so float32 results agree.
    On CUDA it runs megalite.kernels.adamw_step (fused, same math) instead.
    """
    if master.is_cuda:  # one fused Triton pass on GPUs; the torch ops below are the same math
        fused_adamw_step(master, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, 0.0, step)
        return
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
