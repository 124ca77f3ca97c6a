"""The fused output layer + vocab-parallel cross entropy against the unfused path and the tp=1
oracle: per-token losses, the hidden-state gradient and the weight gradient, on odd shapes
(tokens not a multiple of the chunk, padded vocabulary, ignored targets), at tp = 1, 2, 4 with
and without sequence parallelism, with the torch statistics and the Triton kernels."""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.kernels import HAVE_TRITON
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from megalite.testing import assert_tensor_close, run_distributed

SEQ, BATCH, HIDDEN, VOCAB, PADDED = 12, 3, 16, 37, 40  # 36 tokens; vocab padded 37 -> 40 (divisible by 4)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g) * 0.5
    targets = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    targets[0, 0] = targets[5, 2] = -100  # ignored
    dloss = torch.rand(SEQ, BATCH, generator=g)  # a per-token upstream gradient, not only ones
    return hidden, weight, targets, dloss


def _oracle(hidden, weight, targets, dloss):
    """The unpadded, unfused, one-device computation with F.cross_entropy."""
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = (h @ w.t())[..., :VOCAB]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    losses = losses.view(SEQ, BATCH)
    losses.backward(dloss)
    return losses.detach(), h.grad, w.grad


def _fused(hidden, weight, targets, dloss, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    losses = vocab_parallel_linear_cross_entropy(h, w, targets, **kwargs)
    losses.backward(dloss)
    return losses.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_tokens", [1, 7, 36, 1000])
def test_fused_matches_unfused_and_torch_on_one_device(chunk_tokens):
    hidden, weight, targets, dloss = _inputs()
    expected = _oracle(hidden, weight, targets, dloss)
    got = _fused(hidden, weight, targets, dloss, vocab_size=VOCAB, chunk_tokens=chunk_tokens)
    for a, b, what in zip(got, expected, ("losses", "d hidden", "d weight")):
        assert_tensor_close(a, b, 1e-6, what)
    assert float(got[0][0, 0]) == 0.0 and float(got[0][5, 2]) == 0.0  # ignored targets
    assert float(got[2][VOCAB:].abs().max()) == 0.0  # padding rows get no gradient
    # and the unfused megalite path it replaces
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    unfused = vocab_parallel_cross_entropy(h @ w.t(), targets, vocab_size=VOCAB)
    unfused.backward(dloss)
    assert_tensor_close(got[0], unfused, 1e-6, "losses vs unfused")
    assert_tensor_close(got[1], h.grad, 1e-6, "d hidden vs unfused")


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_fused_runs_the_triton_kernels_per_chunk(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MEGALITE_KERNEL_POISON", "1")
    hidden, weight, targets, dloss = _inputs(1)
    expected = _oracle(hidden, weight, targets, dloss)
    got = _fused(hidden, weight, targets, dloss, vocab_size=VOCAB, chunk_tokens=10)
    for a, b, what in zip(got, expected, ("losses", "d hidden", "d weight")):
        assert_tensor_close(a, b, 1e-5, what)


def test_fused_rejects_bad_shapes_and_targets():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match="do not fit hidden"):
        vocab_parallel_linear_cross_entropy(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="is not \\[V/tp, 16\\]"):
        vocab_parallel_linear_cross_entropy(hidden, weight[:, :5], targets)
    bad = targets.clone()
    bad[1, 1] = VOCAB
    with pytest.raises(ValueError, match="outside \\[0, 37\\)"):
        vocab_parallel_linear_cross_entropy(hidden, weight, bad, vocab_size=VOCAB)


def _check_tp(tp, sequence_parallel):
    m = mesh.init_mesh(tp=tp)
    hidden, weight, targets, dloss = _inputs(2)
    losses_ref, dh_ref, dw_ref = _oracle(hidden, weight, targets, dloss)
    rows = PADDED // tp
    w_shard = weight[m.tp_rank * rows:(m.tp_rank + 1) * rows]
    seq = SEQ // tp if sequence_parallel else SEQ
    h_in = hidden[m.tp_rank * seq:(m.tp_rank + 1) * seq] if sequence_parallel else hidden
    comm.ledger.reset()
    h = h_in.clone().requires_grad_(True)
    w = w_shard.clone().requires_grad_(True)
    losses = vocab_parallel_linear_cross_entropy(h, w, targets, m.tp_group, sequence_parallel=sequence_parallel,
                                                 vocab_size=VOCAB, chunk_tokens=5)
    forward_calls = dict(comm.ledger.calls)
    losses.backward(dloss)
    assert_tensor_close(losses, losses_ref, 1e-6, "losses")
    dh_expected = dh_ref[m.tp_rank * seq:(m.tp_rank + 1) * seq] if sequence_parallel else dh_ref
    assert_tensor_close(h.grad, dh_expected, 1e-5, "d hidden")
    assert_tensor_close(w.grad, dw_ref[m.tp_rank * rows:(m.tp_rank + 1) * rows], 1e-5, "d weight shard")
    # forward: one stats all-reduce [tokens, 2tp + 1] fp32 (+ the sequence all-gather under SP)
    assert forward_calls[("tp", "all_reduce")] == 1
    assert comm.ledger.bytes[("tp", "all_reduce")] == SEQ * BATCH * (2 * tp + 1) * 4 + \
        (0 if sequence_parallel else SEQ * BATCH * HIDDEN * 4)  # backward: dh all-reduce without SP
    return True


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_fused_vocab_parallel_matches_the_one_device_oracle(tp, sequence_parallel):
    assert all(run_distributed(_check_tp, tp, tp, sequence_parallel))
