"""SwiGLU (Shazeer 2020): silu(gate) * up, the Llama MLP's activation.

Elementwise in fp32, rounded once to the input dtype. Backward recomputes sigmoid(gate):

    y = g * sigmoid(g) * u
    d_up   = dy * g * sigmoid(g)
    d_gate = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
"""
from __future__ import annotations

import torch

from .dispatch import cdiv, check_float_dtype, check_same_device, new_output, runnable, tl, triton, use_triton

BLOCK = 1024


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 math rounded once, like the kernel (F.silu(gate) * up in half precision rounds twice)."""
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


@triton.jit
def _swiglu_forward_kernel(GATE, UP, Y, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DY, GATE, UP, DGATE, DUP, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DUP + offs, (dy * silu).to(DUP.dtype.element_ty), mask=mask)
    tl.store(DGATE + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGATE.dtype.element_ty), mask=mask)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = new_output(gate.shape, gate.dtype, gate.device)
        grid = (cdiv(gate.numel(), BLOCK),)
        runnable(_swiglu_forward_kernel, gate.device)[grid](gate, up, y, gate.numel(), BLOCK=BLOCK, num_warps=4)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        d_gate = new_output(gate.shape, gate.dtype, gate.device)
        d_up = new_output(up.shape, up.dtype, up.device)
        grid = (cdiv(gate.numel(), BLOCK),)
        runnable(_swiglu_backward_kernel, gate.device)[grid](dy, gate, up, d_gate, d_up, gate.numel(), BLOCK=BLOCK,
                                                             num_warps=4)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of the same shape and dtype; fp32 math, returns gate.dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {list(gate.shape)} {gate.dtype} and up {list(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    if gate.numel() == 0 or not use_triton(gate):
        return swiglu_reference(gate, up)
    check_same_device("swiglu", gate, up)
    check_float_dtype("swiglu", gate, "gate")
    return _SwiGLUFunction.apply(gate, up)
