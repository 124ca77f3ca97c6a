"""The FP8 linear against torch references built here: the cast by hand, the GEMMs dequantised."""
import pytest
import torch

from megalite.fp8 import Fp8Recipe, gemm
from megalite.fp8.linear import fp8_linear
from megalite.fp8.scaling import quantize


def _dq(t, dtype, dim=None, pow2=True):
    """Quantise-dequantise with an independent computation of the scale (max / amax, or the power of
    two at or below it)."""
    limit = torch.finfo(dtype).max
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = limit / a.clamp(min=1e-12)
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale.double())).float()
    return (t * scale).clamp(-limit, limit).to(dtype).float() / scale


@pytest.mark.parametrize("fmt,recipe,scales", [("e4m3", "tensorwise", "pow2"), ("hybrid", "tensorwise", "pow2"),
                                               ("hybrid", "rowwise", "pow2"), ("hybrid", "tensorwise", "exact"),
                                               ("e4m3", "rowwise", "exact")])
def test_fp8_linear_matches_the_dequantised_reference(fmt, recipe, scales):
    torch.manual_seed(0)
    r = Fp8Recipe(fmt, recipe, scales)
    dq = lambda t, dtype, dim=None: _dq(t, dtype, dim, r.pow2_scales)  # noqa: E731
    x = torch.randn(3, 5, 32, requires_grad=True)  # [s, b, K]
    w = torch.randn(24, 32, requires_grad=True)  # [N, K]
    b = torch.randn(24, requires_grad=True)
    g = torch.randn(3, 5, 24)
    y = fp8_linear(x, w, b, r)
    y.backward(g)
    rw = r.rowwise
    x2, g2 = x.detach().reshape(-1, 32), g.reshape(-1, 24)
    y_ref = dq(x2, r.forward_dtype, -1 if rw else None) @ dq(w.detach(), r.forward_dtype, -1 if rw else None).t()
    dx_ref = dq(g2, r.grad_dtype, -1 if rw else None) @ dq(w.detach(), r.forward_dtype, 0 if rw else None)
    dw_ref = dq(g2, r.grad_dtype, 0 if rw else None).t() @ dq(x2, r.forward_dtype, 0 if rw else None)
    torch.testing.assert_close(y.detach().reshape(-1, 24), y_ref + b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 32), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, dw_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, g2.sum(0))
    # and FP8 is an approximation of the fp32 layer, a few percent off, not more
    exact = x2 @ w.detach().t()
    assert (y.detach().reshape(-1, 24) - b.detach() - exact).norm() / exact.norm() < 0.08


def test_scaled_mm_fallback_computes_the_same():
    torch.manual_seed(1)
    a, bt = torch.randn(8, 16), torch.randn(12, 16)
    a_q, inv_a = quantize(a, torch.float8_e5m2, -1)
    b_q, inv_b = quantize(bt, torch.float8_e5m2, -1)
    fast = gemm.scaled_mm(a_q, b_q.t(), inv_a, inv_b.t(), torch.float32)
    before = gemm.fallbacks
    gemm._UNSUPPORTED.add(gemm._key(a_q, b_q.t(), inv_a, inv_b.t(), torch.float32))
    try:
        slow = gemm.scaled_mm(a_q, b_q.t(), inv_a, inv_b.t(), torch.float32)
    finally:
        gemm._UNSUPPORTED.clear()
    assert gemm.fallbacks == before + 1
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def test_power_of_two_scales_ignore_an_ulp_of_amax():
    """The scale is 2^floor(log2(max / amax)): amax moved by an ulp keeps it (unless a power of two is
    crossed), where the exact scale moves with it and re-rounds every element of the cast."""
    from megalite.fp8.scaling import scale_of

    a = torch.tensor([3.0, 1e-3, 449.0, 1e-12, 7e5])
    pow2 = scale_of(a, torch.float8_e4m3fn)
    assert torch.equal(pow2, 2.0 ** torch.floor(torch.log2(448.0 / a.double())).float())
    assert scale_of(torch.tensor(448.0), torch.float8_e4m3fn) == 1.0  # (an amax at a power of two's boundary)
    assert torch.equal(pow2, scale_of(a.nextafter(torch.full_like(a, 1e9)), torch.float8_e4m3fn))
    assert not torch.equal(scale_of(a, torch.float8_e4m3fn, pow2=False),
                           scale_of(a.nextafter(torch.full_like(a, 1e9)), torch.float8_e4m3fn, pow2=False))


def test_an_all_zero_tensor_casts_to_zeros():
    q, inv = quantize(torch.zeros(4, 8), torch.float8_e4m3fn)
    assert q.float().abs().sum() == 0 and torch.isfinite(inv)
    q, inv = quantize(torch.zeros(0, 8), torch.float8_e4m3fn, 0)  # an expert without tokens
    assert q.shape == (0, 8) and inv.shape == (1, 8)
