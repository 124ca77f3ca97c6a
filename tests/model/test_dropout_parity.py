"""Dropout on, the same seed: the same losses and gradients at tp=2 (with and without sequence
parallelism) and on a pp=2 split as at tp=1, pp=1. Masks depend on the logical element, the
global layer and the draw count only (tensor_parallel/random.py), never on the layout."""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.model import GPTModel, preset
from megalite.testing import run_distributed

B, S = 2, 16


def _config(name):
    extra = dict(num_attention_heads=8, num_query_groups=4) if name == "tiny-llama" else {}
    return preset(name, num_layers=2, seq_length=S, hidden_dropout=0.1, attention_dropout=0.1, **extra)


def _batches(vocab):
    gen = torch.Generator().manual_seed(42)
    return [(torch.randint(0, vocab, (B, S), generator=gen), torch.randint(0, vocab, (B, S), generator=gen))
            for _ in range(2)]  # two microbatches: the second must draw new masks, the same on every layout


def _reference(name):
    cfg = _config(name)
    model = GPTModel(cfg, seed=7).train()
    losses = []
    for ids, labels in _batches(cfg.vocab_size):
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.item())
    grads = {n: P.shard_spec(p).assemble([p.grad]) for n, p in model.logical_parameters()}
    return losses, grads


def _tensor_parallel(name, ref_losses, ref_grads):
    m = mesh.init_mesh(tp=2)
    cfg = _config(name)
    for sequence_parallel in (False, True):
        model = GPTModel(cfg, m, seed=7, sequence_parallel=sequence_parallel).train()
        losses = []
        for ids, labels in _batches(cfg.vocab_size):
            loss = model(ids, labels)
            loss.backward()
            losses.append(loss.item())
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        for logical, p in model.logical_parameters():
            grad = p.grad
            if P.is_sequence_parallel_grad(p):
                grad = comm.all_reduce(grad.clone(), m.tp_group)  # partial per sequence shard
            torch.testing.assert_close(grad, P.shard_spec(p).shard(ref_grads[logical]), rtol=1e-5, atol=1e-6,
                                       msg=lambda s: f"sp={sequence_parallel} {logical}: {s}")
    return True


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_dropout_masks_do_not_depend_on_the_layout(name):
    ref_losses, ref_grads = _reference(name)
    assert ref_losses[0] != ref_losses[1]
    assert all(run_distributed(_tensor_parallel, 2, name, ref_losses, ref_grads))
    # pp=2: two stages built separately (layers 0 and 1), run one after the other in this process
    cfg = _config(name)
    first = GPTModel(cfg, seed=7, layer_ids=range(0, 1), post_process=False).train()
    last = GPTModel(cfg, seed=7, layer_ids=range(1, 2), pre_process=False).train()
    losses = []
    for ids, labels in _batches(cfg.vocab_size):
        hidden = first(ids)
        received = hidden.detach().requires_grad_()
        loss = last(received, labels)
        loss.backward()
        hidden.backward(received.grad)
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    grads = {}
    for stage in (first, last):
        for logical, p in stage.logical_parameters():  # a tied embedding's two copies add up
            grads[logical] = grads.get(logical, 0) + P.shard_spec(p).assemble([p.grad])
    assert grads.keys() == ref_grads.keys()
    for logical, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[logical], rtol=1e-5, atol=1e-6, msg=lambda s: f"{logical}: {s}")
