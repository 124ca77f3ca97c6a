"""Fused bias-dropout-add: the Triton kernels and the PyTorch path against the plain reference,
masks bit for bit, and nothing kept for backward."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import bias_dropout_add, bias_dropout_add_reference
from megalite.kernels.philox import keep_mask

pytestmark = requires_triton
SEED, OFFSET = 2 ** 61 + 12345, 2 ** 32 - 1000  # counters cross the 2^32 boundary


def _inputs(shape, dtype):
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    return x, torch.randn(shape[-1], device=DEVICE, dtype=dtype), torch.randn(shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.6])
def test_kernel_matches_reference(dtype, p):
    x, bias, residual = _inputs((7, 3, 37), dtype)  # 777 elements: not a multiple of the 1024 block
    compare_with_reference(lambda *t: bias_dropout_add(*t, p, SEED, OFFSET),
                           lambda *t: bias_dropout_add_reference(*t, p, SEED, OFFSET), [x, bias, residual],
                           tolerance(dtype, fp32=0.0, fp16=0.0, bf16=0.0), grad_tol=tolerance(dtype, fp16=2e-3))


def test_kernel_mask_is_the_philox_mask_and_optional_operands():
    x = torch.ones(5, 300, device=DEVICE)
    dropped = bias_dropout_add(x, None, None, 0.25, SEED, OFFSET)  # plain dropout
    keep = keep_mask(SEED, OFFSET, x.shape, 0.25, DEVICE)
    assert torch.equal(dropped != 0, keep)
    assert torch.equal(dropped[keep], torch.full_like(dropped[keep], 1 / 0.75))
    residual = torch.randn_like(x)
    assert torch.equal(bias_dropout_add(x, None, residual, 0.25, SEED, OFFSET),
                       bias_dropout_add_reference(x, None, residual, 0.25, SEED, OFFSET))
    shard = bias_dropout_add(x[2:], None, None, 0.25, SEED, OFFSET + 2 * 300)  # a sequence shard
    assert torch.equal(shard, dropped[2:])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_keeps_nothing_for_backward_and_regenerates_the_mask(backend, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
    x, bias, residual = (t.requires_grad_() for t in _inputs((4, 2, 64), torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = bias_dropout_add(x, bias, residual, 0.3, SEED, 0)
    assert saved == []
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [t.detach().clone().requires_grad_() for t in (x, bias, residual)]
    expected = bias_dropout_add_reference(*ref, 0.3, SEED, 0)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(x.grad, ref[0].grad) and torch.equal(residual.grad, grad)
    torch.testing.assert_close(bias.grad, ref[1].grad, rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_fix():
    x, bias, residual = _inputs((4, 8), torch.float32)
    with pytest.raises(ValueError, match="1-D bias of size 8"):
        bias_dropout_add(x, bias[:4], residual, 0.1, SEED)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        bias_dropout_add(x, bias, residual, 1.0, SEED)
    with pytest.raises(ValueError, match="seed must be in"):
        bias_dropout_add(x, bias, residual, 0.1, -1)
    with pytest.raises(ValueError, match="residual shape"):
        bias_dropout_add(x, bias, residual[:2], 0.1, SEED)
