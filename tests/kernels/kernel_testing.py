"""Shared helpers for the kernel tests: device, dtypes, tolerances, comparison with a reference.

(A uniquely named module rather than conftest.py, so test files can import it unambiguously.)
"""
from __future__ import annotations

import pytest
import torch

from megalite.kernels import HAVE_TRITON
from megalite.kernels.dispatch import interpreter_ready
from megalite.kernels.norm_config import NormConfig

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# Triton's interpreter has no bfloat16 dot (numpy lacks the type): bf16 cases run on GPUs only.
FLOAT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# The in-process kernel tests: need triton, and on CPU an interpretable triton (see conftest.py).
KERNELS_RUNNABLE_HERE = HAVE_TRITON and (ON_GPU or interpreter_ready())
requires_triton = pytest.mark.skipif(
    not KERNELS_RUNNABLE_HERE,
    reason="triton missing, or imported before tests/kernels/conftest.py without TRITON_INTERPRET=1 "
           "(test_isolated_run.py then runs these tests in a fresh process)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="GPU-only: large shapes are too slow for the interpreter")
# Norm launch configs (rows per tile, warps, programs per SM; CPU counts 2 SMs) for 15 rows: 2 programs
# of 8 and 7 one-row tiles; 4 programs of one 2-row tile (6 allowed, none left empty); 4 programs of
# one 4-row tile, the last with 3 rows; 1 program with one 16-row tile holding 15.
NORM_LAUNCH_CONFIGS = [NormConfig(1, 1, 1), NormConfig(2, 2, 3), NormConfig(4, 4, 2), NormConfig(16, 4, 1)]


def tolerance(dtype: torch.dtype, fp32: float = 1e-5, fp16: float = 2e-3, bf16: float = 1.6e-2) -> dict:
    """atol = rtol for assert_close: float32 near its rounding, half types a couple of ulps."""
    tol = {torch.float32: fp32, torch.float16: fp16, torch.bfloat16: bf16}[dtype]
    return dict(atol=tol, rtol=tol)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def compare_with_reference(op, reference, inputs, tol: dict, ref_dtype: torch.dtype | None = None,
                           grad_tol: dict | None = None):
    """Run op and reference on copies of `inputs`; assert outputs and input gradients match.

    ref_dtype upcasts the reference's floating inputs (e.g. float32 for a float16 kernel whose
    reference would otherwise round differently); the comparison then happens in that dtype.
    Returns the kernel's outputs.
    """
    kernel_inputs = [leaf(t) if t.is_floating_point() else t for t in inputs]
    ref_inputs = [leaf(t.to(ref_dtype) if ref_dtype else t) if t.is_floating_point() else t for t in inputs]
    out = op(*kernel_inputs)
    expected = reference(*ref_inputs)
    outs = out if isinstance(out, tuple) else (out,)
    expecteds = expected if isinstance(expected, tuple) else (expected,)
    grads = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in outs]
    for o, e in zip(outs, expecteds):
        assert o.dtype == (inputs[0].dtype if ref_dtype is None else o.dtype)
        torch.testing.assert_close(o.to(e.dtype), e, **tol)
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(expecteds, [g.to(e.dtype) for g, e in zip(grads, expecteds)])
    for i, (k, r) in enumerate(zip(kernel_inputs, ref_inputs)):
        if k.is_floating_point():
            assert k.grad is not None, f"no gradient for input {i}"
            assert torch.isfinite(k.grad).all(), f"gradient of input {i} has NaN/inf (an unwritten element?)"
            torch.testing.assert_close(k.grad.to(r.grad.dtype), r.grad, **(grad_tol or tol), msg=f"grad of input {i}")
    return out
