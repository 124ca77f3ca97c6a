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


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bias_gradient_sums_the_unrounded_fp32_products(backend, monkeypatch):
    """p = 0.6 (scale 2.5): a kept dout of 1 + 2^-10 (exact in fp16) gives dx = 2.5 + 2^-9 + 2^-11 in
    fp32, which fp16 rounds down by 2^-11; a kept -1 gives -2.5, exact. Each column's kept elements
    alternate between the two (an odd last one gets 0), so its exact bias gradient is
    pairs * 2.5 * 2^-10, while summing the rounded dx gives pairs * 2^-9, 20% less."""
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
    p, shape = 0.6, (37, 300)  # 2 column blocks of 256, several row groups, a partial last row tile
    keep = keep_mask(SEED, OFFSET, shape, p, DEVICE)
    kept_count = keep.sum(0)  # [300]
    rank = keep.long().cumsum(0) - 1  # per column, each kept element's rank among the column's kept ones
    dout = torch.where(rank % 2 == 0, 1 + 2 ** -10, -1.0)
    dout = torch.where((kept_count % 2 == 1) & (rank == kept_count - 1), 0.0, dout)  # odd leftover
    dout = torch.where(keep, dout, 3.0).to(torch.float16)  # dropped elements must add nothing
    pairs = kept_count // 2
    assert (pairs > 0).all()
    x, bias, residual = (t.requires_grad_() for t in _inputs(shape, torch.float16))
    bias_dropout_add(x, bias, residual, p, SEED, OFFSET).backward(dout)

    expected_dbias = (pairs.double() * 2.5 * 2 ** -10).to(torch.float16)  # exact in fp16
    expected_dx = torch.where(keep, dout.float() * 2.5, 0.0).to(torch.float16)
    assert torch.equal(expected_dx.float().sum(0), pairs * 2.0 ** -9)  # the trap: rounded dx sums 20% short
    assert torch.equal(bias.grad, expected_dbias)
    assert torch.equal(x.grad, expected_dx) and torch.equal(residual.grad, dout)
    ref = [t.detach().clone().requires_grad_() for t in (x, bias, residual)]
    bias_dropout_add_reference(*ref, p, SEED, OFFSET).backward(dout)  # the fp32 definition's autograd
    assert torch.equal(bias.grad, ref[1].grad) and torch.equal(x.grad, ref[0].grad)


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
