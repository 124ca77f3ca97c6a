"""Region functions (forward and backward), vocab-parallel cross entropy (dropout: test_random.py)."""
import pytest
import torch
import torch.nn.functional as F

from megalite.distributed import comm, mesh
from megalite.tensor_parallel import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                      gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
                                      vocab_parallel_cross_entropy)
from megalite.testing import run_distributed


def _per_rank(shape, rank, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 100 * rank))


def _check_regions(tp):
    m = mesh.init_mesh(tp=tp)
    r, g = m.tp_rank, m.tp_group
    all_x = [_per_rank((8, 8), i) for i in range(tp)]  # what every rank would hold
    all_dy = [_per_rank((8, 8), i, seed=7) for i in range(tp)]
    total_x, total_dy = sum(all_x), sum(all_dy)

    def run(fn, x, dy):
        x = x.clone().requires_grad_()
        y = fn(x, g)
        y.backward(dy)
        return y.detach(), x.grad

    # f: identity forward, all-reduce backward
    y, dx = run(copy_to_tensor_parallel_region, all_x[r], all_dy[r])
    torch.testing.assert_close(y, all_x[r])
    torch.testing.assert_close(dx, total_dy)
    # g: all-reduce forward, identity backward
    y, dx = run(reduce_from_tensor_parallel_region, all_x[r], all_dy[r])
    torch.testing.assert_close(y, total_x)
    torch.testing.assert_close(dx, all_dy[r])
    # scatter / gather along the last dim
    full = all_x[0]  # the same full tensor on every rank
    y, dx = run(scatter_to_tensor_parallel_region, full, all_dy[r][:, : 8 // tp])
    torch.testing.assert_close(y, full.chunk(tp, -1)[r])
    torch.testing.assert_close(dx, torch.cat([d[:, : 8 // tp] for d in all_dy], -1))
    y, dx = run(gather_from_tensor_parallel_region, all_x[r][:, :2], total_dy[:, : 2 * tp])
    torch.testing.assert_close(y, torch.cat([x[:, :2] for x in all_x], -1))
    torch.testing.assert_close(dx, total_dy[:, : 2 * tp].chunk(tp, -1)[r])
    # sequence parallel: dim 0
    y, dx = run(scatter_to_sequence_parallel_region, full, all_dy[r][: 8 // tp])
    torch.testing.assert_close(y, full.chunk(tp, 0)[r])
    torch.testing.assert_close(dx, torch.cat([d[: 8 // tp] for d in all_dy], 0))
    y, dx = run(gather_from_sequence_parallel_region, all_x[r], all_dy[r].repeat(tp, 1))
    torch.testing.assert_close(y, torch.cat(all_x, 0))
    torch.testing.assert_close(dx, total_dy)  # backward: reduce-scatter of partial grads
    y, dx = run(reduce_scatter_to_sequence_parallel_region, all_x[r].repeat(tp, 1), all_dy[r])
    torch.testing.assert_close(y, total_x)
    torch.testing.assert_close(dx, torch.cat(all_dy, 0))
    return True


def _check_cross_entropy(tp):
    m = mesh.init_mesh(tp=tp)
    vocab, padded, tokens = 37, 48, (3, 5)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*tokens, padded, generator=gen) * 3
    targets = torch.randint(0, vocab, tokens, generator=gen)
    targets[0, 1] = targets[2, 4] = -100
    ref_logits = logits[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100,
                          reduction="none").reshape(tokens)
    grad_loss = torch.rand(tokens, generator=gen)
    ref.backward(grad_loss)
    shard = logits.chunk(tp, -1)[m.tp_rank].clone().requires_grad_()
    comm.ledger.reset()
    loss = vocab_parallel_cross_entropy(shard, targets, vocab_size=vocab)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert loss[0, 1] == 0 and loss[2, 4] == 0
    loss.backward(grad_loss)
    full_grad = torch.zeros(*tokens, padded)
    full_grad[..., :vocab] = ref_logits.grad
    torch.testing.assert_close(shard.grad, full_grad.chunk(tp, -1)[m.tp_rank], rtol=1e-5, atol=1e-6)
    if tp > 1:  # one all-reduce of [15 tokens, 2*tp + 1] fp32 (maxima, sum-exps, target logit); none in backward
        assert comm.ledger.calls[("tp", "all_reduce")] == 1
        assert comm.ledger.bytes[("tp", "all_reduce")] == 15 * (2 * tp + 1) * 4
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_region_functions_forward_and_backward(tp):
    assert all(run_distributed(_check_regions, tp, tp))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    assert all(run_distributed(_check_cross_entropy, tp, tp))

