"""Packed documents with multi-head latent attention (d_qk != d_v) at cp 1: a packed batch equals its
documents run one by one, logits, loss and every gradient, float32, 1e-5 (lengths 1 and odd, a
document filling the sequence, masked labels); with a window over the documents too (each document
alone then runs under the same window). At (tp 2, SP) in the slow tier."""
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
DOCUMENTS = ([1, 5, 3, 7], [16])
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12)


def _config(window):
    return preset("tiny-llama", num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                  seq_length=S, mla=MLA, window_size=window)


def _batch(vocab):
    return documents_batch(vocab, DOCUMENTS, S)


def _one_by_one(window):
    cfg = _config(window)
    model = GPTModel(cfg, seed=5)
    return one_by_one(model, DOCUMENTS, S, cfg.vocab_size, cfg.padded_vocab_size(1))


def _packed(window, tp, expected):
    m = mesh.init_mesh(tp=tp) if tp > 1 else None
    cfg = _config(window)
    model = GPTModel(cfg, m, seed=5, sequence_parallel=tp > 1)
    ids, labels, positions = _batch(cfg.vocab_size)
    ref_logits, ref_loss, ref_grads = expected
    logits = model(ids, position_ids=positions).detach()
    shard, rank = logits.shape[-1], (m.tp_rank if m is not None else 0)
    columns = slice(rank * shard, min((rank + 1) * shard, cfg.vocab_size))
    torch.testing.assert_close(logits[..., :columns.stop - columns.start], ref_logits[..., columns],
                               rtol=1e-5, atol=1e-5)
    loss = model(ids, labels, reduction="sum", position_ids=positions)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    for name, p in model.logical_parameters():
        grad = p.grad
        if m is not None and P.is_sequence_parallel_grad(p):
            grad = comm.all_reduce(grad.clone(), m.tp_group)
        assert_tensor_close(grad, P.shard_spec(p).shard(ref_grads[name]), rtol=1e-5, what=name)
    return len(ref_grads)


@pytest.mark.parametrize("window", [4, pytest.param(None, marks=pytest.mark.slow)])  # documents and a window (quick)
def test_latent_attention_documents_equal_documents_run_one_by_one(window):
    expected = _one_by_one(window)
    assert _packed(window, 1, expected) == len(expected[2])
    ids, _, _ = _batch(_config(window).vocab_size)
    model = GPTModel(_config(window), seed=5)  # the oracle can fail: without the mask the logits differ
    assert (model(ids).detach() - expected[0]).abs().max() > 1e-2


@pytest.mark.slow
def test_latent_attention_documents_at_tp2_sp():
    expected = _one_by_one(4)
    assert run_distributed(_packed, 2, 4, 2, expected) == [len(expected[2])] * 2
