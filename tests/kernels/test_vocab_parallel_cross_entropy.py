"""Vocab-parallel cross entropy on real forked gloo ranks (tp = 2 and 4), both backends:
losses and shard gradients equal F.cross_entropy on the gathered logits, and the only
communication is one all-reduce of tokens * (2 tp + 1) fp32 partials in forward, none in backward."""
import os

import pytest
import torch

from kernel_testing import requires_triton
from megalite.distributed import comm, mesh
from megalite.kernels import vocab_parallel_cross_entropy
from megalite.testing import run_distributed

pytestmark = [requires_triton, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

VOCAB = 997
TOKENS = (5, 2)


def _check_rank(tp: int) -> dict:
    m = mesh.init_mesh(tp=tp)
    # tp=2: 2 x 499 columns, one padding column; tp=4: 4 x 340, the last shard all padding
    shard = -(-VOCAB // tp) if tp == 2 else 340
    start = m.tp_rank * shard
    generator = torch.Generator().manual_seed(1234)  # identical data on every rank
    report = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        full = (torch.randn(*TOKENS, shard * tp, generator=generator) * 4).to(dtype)
        targets = torch.randint(0, VOCAB, TOKENS, generator=generator)
        targets[0, 1] = -100
        targets[1, 0] = VOCAB - 1  # the last real column, next to the padding
        weights = torch.rand(*TOKENS, generator=generator)
        reference_logits = full[..., :VOCAB].float().requires_grad_()
        expected = torch.nn.functional.cross_entropy(reference_logits.view(-1, VOCAB), targets.view(-1),
                                                     reduction="none").view(TOKENS)
        (expected * weights).sum().backward()
        expected_grad = torch.zeros(*TOKENS, shard * tp)
        expected_grad[..., :VOCAB] = reference_logits.grad
        for backend in ("torch", "triton"):
            os.environ["MEGALITE_KERNEL_BACKEND"] = backend
            logits_shard = full[..., start:start + shard].clone().requires_grad_()
            comm.ledger.reset()
            losses = vocab_parallel_cross_entropy(logits_shard, targets, start, m.tp_group, vocab_size=VOCAB)
            forward_calls = dict(comm.ledger.calls)
            forward_bytes = comm.ledger.total_bytes()
            (losses * weights).sum().backward()
            assert dict(comm.ledger.calls) == forward_calls == {("tp", "all_reduce"): 1}, comm.ledger.calls
            assert forward_bytes == losses.numel() * (2 * tp + 1) * 4
            torch.testing.assert_close(losses, expected.detach(), atol=tol, rtol=tol)
            torch.testing.assert_close(logits_shard.grad.float(), expected_grad[..., start:start + shard],
                                       atol=tol, rtol=tol)
            report[(str(dtype), backend)] = float(losses.sum())
    return report


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="forked ranks cannot use CUDA once the parent has; the CPU run covers the merging and "
                           "the single-device CE tests cover the same kernels on the GPU")
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full_softmax(tp):
    reports = run_distributed(_check_rank, tp, tp, env={"TRITON_INTERPRET": "1"}, timeout_s=240)
    assert all(r == reports[0] for r in reports)  # every rank computed the same losses
