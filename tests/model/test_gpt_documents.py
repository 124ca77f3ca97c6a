"""Packed documents: a batch of packed documents (position_ids restarting at 0 at each) equals its
documents run one by one as sequences of their own, logits and every gradient, float32, 1e-5; at
(1, 1, 1) in-process and at (tp 2, SP) over two forked ranks. Documents of 1 token, odd lengths, and
a sample that is one document filling the whole sequence; some labels masked (-100)."""
import os
import sys

import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.model import GPTModel, preset
from megalite.testing import assert_tensor_close, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from packed_documents import documents_batch, one_by_one  # noqa: E402

B, S = 2, 16
DOCUMENTS = ([1, 5, 3, 7], [16])  # per sample; 16: the whole sequence


def _config(name):
    return preset(name, num_layers=2, seq_length=S)


def _batch(vocab):
    return documents_batch(vocab, DOCUMENTS, S)


def _one_by_one(name):
    """Each document alone through a tp=1 model: its logits, the summed loss, every gradient."""
    cfg = _config(name)
    model = GPTModel(cfg, seed=5)
    return one_by_one(model, DOCUMENTS, S, cfg.vocab_size, cfg.padded_vocab_size(1))


def _packed(name, tp, sequence_parallel, expected):
    """The packed batch at tp (a mesh when tp > 1); compares with `expected` on every rank."""
    m = mesh.init_mesh(tp=tp) if tp > 1 else None
    cfg = _config(name)
    model = GPTModel(cfg, m, seed=5, sequence_parallel=sequence_parallel)
    ids, labels, positions = _batch(cfg.vocab_size)
    ref_logits, ref_loss, ref_grads = expected
    logits = model(ids, position_ids=positions).detach()  # [b, s, V/tp]
    shard, rank = logits.shape[-1], (m.tp_rank if m is not None else 0)
    columns = slice(rank * shard, min((rank + 1) * shard, cfg.vocab_size))  # this rank's real vocabulary
    real = logits[..., :columns.stop - columns.start]
    torch.testing.assert_close(real, ref_logits[..., columns], rtol=1e-5, atol=1e-5)
    loss = model(ids, labels, reduction="sum", position_ids=positions)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    checked = 0
    for name_, p in model.logical_parameters():
        grad = p.grad
        if m is not None and P.is_sequence_parallel_grad(p):
            grad = comm.all_reduce(grad.clone(), m.tp_group)  # partial per sequence shard
        # relative to the whole tensor: position row 0 sums one term per document (|term| ~ 4) in another
        # order than the one-by-one runs' accumulation, and where they cancel an element is float32 noise
        assert_tensor_close(grad, P.shard_spec(p).shard(ref_grads[name_]), rtol=1e-5, what=name_)
        checked += 1
    return checked


# RoPE, and the learned position table (slow tier: the same code but the embedding)
@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("tiny", marks=pytest.mark.slow)])
def test_packed_documents_equal_documents_run_one_by_one(name):
    expected = _one_by_one(name)
    assert _packed(name, 1, False, expected) == len(expected[2])
    assert run_distributed(_packed, 2, name, 2, True, expected) == [len(expected[2])] * 2


def test_without_position_ids_documents_attend_to_each_other():
    """The test above can fail: the same batch without position_ids (one causal sequence) differs."""
    cfg = _config("tiny-llama")
    model = GPTModel(cfg, seed=5)
    ids, labels, positions = _batch(cfg.vocab_size)
    packed = model(ids, labels, position_ids=positions)
    assert not torch.allclose(model(ids, labels), packed, rtol=1e-3)
    # the mean is over the unmasked targets of the whole batch
    torch.testing.assert_close(packed, model(ids, labels, reduction="sum", position_ids=positions)
                               / (labels != -100).sum(), rtol=1e-6, atol=0)
