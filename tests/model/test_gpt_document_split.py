"""A GPT under the per-document cp split (cp_split="documents"; context_parallel/document_split.py) at
(cp 2 ring) and (cp 2 Ulysses) equals its documents run one by one: logits, loss sum and every
gradient, float32, 1e-5.

Each cp rank is handed its tokens of the ids and labels under the split (`local_tokens` of the order
`split_order` computes from the position ids, as the training step does) and the whole sequence's
position ids. Lengths 1 and odd (their ends past the 2cp equal chunks dealt as one zigzag sequence),
multiples of 2cp (the split's exact case), a document filling the sequence; some labels masked. The
model refuses what the split does not run.
"""
import os
import sys

import pytest
import torch

from megalite.context_parallel.document_split import gather_tokens, local_tokens, split_order
from megalite.distributed import comm, mesh
from megalite.model import GPTModel, preset
from megalite.parameters import params as P
from megalite.testing import assert_tensor_close, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from packed_documents import documents_batch, one_by_one  # noqa: E402

S = 16
DOCUMENTS = ([1, 5, 3, 7], [16], [8, 4, 4])  # per sample; at cp 2 each document's chunks are length // 4
MASKED = ((0, 2), (1, 13), (2, 6))


def _one_by_one(name):
    cfg = preset(name, num_layers=1, seq_length=S)
    return one_by_one(GPTModel(cfg, seed=5), DOCUMENTS, S, cfg.vocab_size, cfg.padded_vocab_size(1), masked=MASKED)


def _rank(name, comm_types, expected):
    m = mesh.init_mesh(cp=2)
    cfg = preset(name, num_layers=1, seq_length=S)
    ids, labels, positions = documents_batch(cfg.vocab_size, DOCUMENTS, S, masked=MASKED)
    order = split_order(positions, m.cp_size)
    ids, labels = (local_tokens(t, order, cp_rank=m.cp_rank, cp=m.cp_size) for t in (ids, labels))
    ref_logits, ref_loss, ref_grads = expected
    checked = {}
    for comm_type in comm_types:
        model = GPTModel(cfg, m, seed=5, cp_comm_type=comm_type, cp_split="documents")
        logits = model(ids, position_ids=positions).detach()  # [b, s/cp, V]: this rank's tokens
        pieces = comm.all_gather(logits.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        torch.testing.assert_close(gather_tokens(list(pieces), order)[..., :cfg.vocab_size],
                                   ref_logits[..., :cfg.vocab_size], rtol=1e-5, atol=1e-5)
        loss = model(ids, labels, reduction="sum", position_ids=positions)
        loss.backward()
        torch.testing.assert_close(comm.all_reduce(loss.detach().clone(), m.cp_group), ref_loss, rtol=1e-5, atol=0)
        for name_, p in model.logical_parameters():  # replicated over cp: each rank holds its tokens' part
            assert_tensor_close(comm.all_reduce(p.grad.clone(), m.cp_group), P.shard_spec(p).shard(ref_grads[name_]),
                                rtol=1e-5, what=f"{comm_type} {name_}")
        checked[comm_type] = len(ref_grads)
    return checked


@pytest.mark.parametrize("name, comm_types", [
    ("tiny-llama", ("p2p",)),  # RoPE read by each token's position id
    pytest.param("tiny-llama", ("a2a",), marks=pytest.mark.slow),  # Ulysses (quick at the attention level)
    pytest.param("tiny", ("p2p",), marks=pytest.mark.slow)])  # the learned position table
def test_a_gpt_under_the_document_split_equals_its_documents_one_by_one(name, comm_types):
    expected = _one_by_one(name)
    results = run_distributed(_rank, 2, name, comm_types, expected)
    assert results == [{t: len(expected[2]) for t in comm_types}] * 2


def _refusal(cfg):
    m = mesh.init_mesh(cp=2)
    try:
        GPTModel(cfg, m, cp_split="documents")
    except ValueError as exc:
        return str(exc)
    return None


def test_the_model_refuses_what_the_split_does_not_run():
    cfg = preset("tiny-llama", num_layers=1, seq_length=S, hidden_dropout=0.1)
    assert run_distributed(_refusal, 2, cfg) == ["cp_split='documents' does not run with dropout yet; use "
                                                 "cp_split='zigzag'"] * 2
