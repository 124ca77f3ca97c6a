"""Weight gradients reach the parameter's declared destination under a saved-tensor hook.

A hook such as torch.autograd.graph.save_on_cpu (activation offloading), or --simulate's memory
count, hands backward another Python object for each saved tensor, parameters included. The
routing (megalite.parameters.weight_grad: the data-parallel engine's sink, ZB-H1's deferral) is declared on the
parameter, so each autograd node asks it of the parameter kept on its ctx. Every node that routes
weight gradients is run here with and without a cloning hook: the sink must receive the same
gradients, and `.grad` must stay empty.
"""
import pytest
import torch

from megalite.parameters import params as P
from megalite.fp8.blockwise import blockwise_linear
from megalite.fp8.grouped import fp8_grouped_mm
from megalite.fp8.linear import fp8_linear
from megalite.fp8.recipe import Fp8Recipe
from megalite.tensor_parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from megalite.tensor_parallel.layers import linear


def _plain(x, params):
    return linear(x, params[0], params[1])


def _fused_cross_entropy(x, params):
    targets = torch.arange(x.shape[0] * x.shape[1]).remainder(params[0].shape[0]).view(x.shape[0], x.shape[1])
    return vocab_parallel_linear_cross_entropy(x, params[0], targets, chunk_tokens=3)


def _fp8(x, params):
    return fp8_linear(x, params[0], params[1], Fp8Recipe("hybrid", "tensorwise"))


def _fp8_rowwise(x, params):
    return fp8_linear(x, params[0], params[1], Fp8Recipe("hybrid", "rowwise"))


def _blockwise(x, params):
    return blockwise_linear(x, params[0], params[1], Fp8Recipe("hybrid", "blockwise"))


def _grouped(x, params):
    rows = x.reshape(-1, x.shape[-1])
    return fp8_grouped_mm(rows, torch.tensor([rows.shape[0] - 16, 16]), list(params), Fp8Recipe("hybrid", "tensorwise"))


# (name, function, parameter shapes, dtype): x is [s 8, b 4, 128]
CASES = [("linear", _plain, [(32, 128), (32,)], torch.float32),
         ("fused cross entropy", _fused_cross_entropy, [(40, 128)], torch.float32),
         ("fp8 tensorwise", _fp8, [(32, 128), (32,)], torch.bfloat16),
         ("fp8 rowwise", _fp8_rowwise, [(32, 128), (32,)], torch.bfloat16),
         ("fp8 blockwise", _blockwise, [(128, 128), (128,)], torch.bfloat16),
         ("fp8 grouped experts", _grouped, [(32, 128), (32, 128)], torch.bfloat16)]


def _sunk_grads(fn, shapes, dtype, hook: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype) / 8) for shape in shapes]
    received = {}
    for i, p in enumerate(params):
        P.set_grad_destination(p, lambda param, grad, i=i: received.__setitem__(i, received.get(i, 0) + grad), None)
    x = torch.randn(8, 4, 128, dtype=dtype, requires_grad=True)
    if hook:  # what offloading does: backward gets other objects holding the same values
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = fn(x, params)
    else:
        out = fn(x, params)
    out.float().square().sum().backward()
    return received, [p.grad for p in params], x.grad


@pytest.mark.parametrize("name,fn,shapes,dtype", CASES, ids=[c[0] for c in CASES])
def test_weight_gradients_reach_the_sink_under_a_saved_tensor_hook(name, fn, shapes, dtype):
    reference, _, reference_dx = _sunk_grads(fn, shapes, dtype, hook=False)
    received, autograd_grads, dx = _sunk_grads(fn, shapes, dtype, hook=True)
    assert sorted(reference) == list(range(len(shapes))), f"{name}: the sink should take every weight gradient"
    assert sorted(received) == sorted(reference), f"{name}: under the hook the sink got {sorted(received)}"
    assert all(g is None for g in autograd_grads), f"{name}: a routed gradient reached .grad under the hook"
    for i in reference:
        torch.testing.assert_close(received[i], reference[i], rtol=0, atol=0)
    torch.testing.assert_close(dx, reference_dx, rtol=0, atol=0)
