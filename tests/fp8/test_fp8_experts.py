"""The experts' grouped FP8 GEMM (megalite.fp8.grouped) against the per-expert loop through the FP8
linear: on torch the same bits (the same casts, one _scaled_mm per expert on the same operands);
on the Triton kernels (interpreted) the same casts and GEMMs within fp32 summation order."""
import os

import pytest
import torch

from megalite.fp8 import Fp8Recipe
from megalite.fp8.experts import fp8_experts_forward, per_expert_reference
from megalite.moe.experts import LocalExperts

SIZES = [5, 0, 9, 2]  # rows per local expert; one expert without tokens


def _run(forward, recipe, gated, backend, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
    experts = LocalExperts(24, 32, gated=gated, expert_ids=range(4), base_seed=7, init_std=0.05, num_layers=2, tp_group=None)
    experts.fp8 = recipe
    torch.manual_seed(3)
    x = torch.randn(sum(SIZES), 24, requires_grad=True)
    y = forward(experts, x, torch.tensor(SIZES))
    y.backward(torch.randn_like(y))
    weights = [p.grad for e in experts.values() for p in (e.fc1_weight, e.fc2_weight)]
    return [y.detach(), x.grad, *weights]


@pytest.mark.parametrize("fmt,recipe,gated", [("hybrid", "tensorwise", True), ("e4m3", "tensorwise", False),
                                              ("hybrid", "rowwise", True)])
def test_grouped_equals_the_per_expert_loop_bit_for_bit_on_torch(fmt, recipe, gated, monkeypatch):
    r = Fp8Recipe(fmt, recipe)
    got = _run(fp8_experts_forward, r, gated, "torch", monkeypatch)
    expected = _run(per_expert_reference, r, gated, "torch", monkeypatch)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), i
    assert got[2 + 2].abs().sum() == 0 and got[2 + 3].abs().sum() == 0  # expert 1 had no token: zero gradients
    assert got[2].abs().sum() > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_grouped_kernels_match_the_per_expert_loop(recipe, monkeypatch):
    """kernels/grouped_gemm.py with FP8 operands and scales (Triton interpreter): within 1e-5 of the
    loop (the fp32 sums run in another order; the casts are the same bits)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megalite.kernels import grouped_gemm

    launches = []
    real = grouped_gemm._launch_mm
    monkeypatch.setattr(grouped_gemm, "_launch_mm", lambda *a, **k: launches.append(1) or real(*a, **k))
    r = Fp8Recipe("hybrid", recipe)
    got = _run(fp8_experts_forward, r, True, "triton", monkeypatch)
    expected = _run(per_expert_reference, r, True, "torch", monkeypatch)
    assert len(launches) == 4  # forward and dx of fc1 and fc2
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"output {i}")


def test_a_gemm_over_no_rows_is_zero_not_uninitialised_memory():
    """torch 2.13's CPU _scaled_mm returns uninitialised memory when K = 0 (an expert that got no token
    computes its weight gradient over zero rows); scaled_mm must return zeros."""
    from megalite.fp8.gemm import scaled_mm

    a = torch.zeros(4, 0).to(torch.float8_e4m3fn)
    b = torch.zeros(8, 0).to(torch.float8_e4m3fn).t()
    for _ in range(3):
        torch.randn(4096).mul_(1e3)  # leave garbage where the next allocation may land
        out = scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0), torch.float32)
        assert out.shape == (4, 8) and torch.equal(out, torch.zeros(4, 8))
