"""Packed documents and sliding windows under context parallelism: a GPT at (cp 2 ring) and (cp 2
Ulysses) equals the single process, logits, loss sum and every gradient, float32, 1e-5.

Each cp rank is handed its zigzag chunks of the ids and labels and the WHOLE sequence's position
ids (as the training step hands them). Packed documents are compared with the documents run one by
one (tests/model/test_gpt_documents.py's oracle): lengths 1 and odd, documents crossing the chunk
edges (chunks of 4 tokens), a sample that is one document; some labels masked. A window of 5, alone
and over the documents, is compared with the same model at cp 1.
"""
import os
import sys

import pytest
import torch

from megalite.distributed import mesh
from megalite.model import GPTModel, preset
from megalite.testing import assert_tensor_close, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from packed_documents import documents_batch, one_by_one, packed_run  # noqa: E402

B, S = 2, 16
DOCUMENTS = ([1, 5, 3, 7], [16])  # per sample; at cp 2 the chunks are [0, 4), [4, 8), [8, 12), [12, 16)
WINDOW = 5


def _config(name, window=None):
    return preset(name, num_layers=1, seq_length=S, window_size=window)


MASKED = ((0, 2), (1, 13))  # masked targets on both cp ranks


def _batch(vocab, documents=True):
    ids, labels, positions = documents_batch(vocab, DOCUMENTS, S, masked=MASKED)
    return ids, labels, (positions if documents else None)


def _one_by_one(name):
    """Each document alone at cp 1: logits [b, s, V], the summed loss, every gradient."""
    cfg = _config(name)
    model = GPTModel(cfg, seed=5)
    return one_by_one(model, DOCUMENTS, S, cfg.vocab_size, cfg.padded_vocab_size(1), masked=MASKED)


def _single_process(name, window, documents):
    """The packed batch at cp 1 with the window."""
    cfg = _config(name, window)
    logits, loss, _, grads = packed_run(GPTModel(cfg, seed=5), *_batch(cfg.vocab_size, documents))
    return logits, loss, grads


CASES = {"documents": (None, True), "window": (WINDOW, False), "documents+window": (WINDOW, True)}


def _expected(name, cases):
    return {case: (_one_by_one(name) if case == "documents" else _single_process(name, *CASES[case]))
            for case in cases}


def _context_parallel(m, name, comm_type, case, expected):
    """The cp run against `expected` (logits, loss sum, every gradient); returns the gradients checked."""
    window, documents = CASES[case]
    cfg = _config(name, window)
    model = GPTModel(cfg, m, seed=5, cp_comm_type=comm_type)
    logits, loss, _, grads = packed_run(model, *_batch(cfg.vocab_size, documents))  # the whole sequence's
    ref_logits, ref_loss, ref_grads = expected
    torch.testing.assert_close(logits[..., :cfg.vocab_size], ref_logits[..., :cfg.vocab_size], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name_, grad in grads.items():  # summed over cp: each rank held its tokens' part
        assert_tensor_close(grad, ref_grads[name_], rtol=1e-5, what=f"{comm_type} {case} {name_}")
    return len(ref_grads)


def _rank(name, expected):
    m = mesh.init_mesh(cp=2)
    return {(comm_type, case): _context_parallel(m, name, comm_type, case, expected[case])
            for comm_type in ("p2p", "a2a") for case in expected}


# RoPE with documents against the documents run one by one (quick); windows (with and without documents:
# quick at the attention level, tests/context_parallel/test_ring_documents.py) and the learned position
# table in the slow tier
@pytest.mark.parametrize("name,cases", [
    ("tiny-llama", ("documents",)),
    pytest.param("tiny-llama", ("window", "documents+window"), marks=pytest.mark.slow),
    pytest.param("tiny", tuple(CASES), marks=pytest.mark.slow)])
def test_documents_and_windows_at_cp2_equal_the_single_process(name, cases):
    expected = _expected(name, cases)
    results = run_distributed(_rank, 2, name, expected)
    checked = len(expected[cases[0]][2])
    assert results == [{(t, c): checked for t in ("p2p", "a2a") for c in cases}] * 2
