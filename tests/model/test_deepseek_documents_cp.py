"""DeepSeek's pieces with packed documents and sliding windows under context parallelism: latent attention
(d_qk 16 != d_v 12) and multi-token prediction (two depths), together, at cp 2 with ring attention and with
Ulysses equal the single process: logits, the loss sum, each depth's summed loss and every gradient,
float32, 1e-5 (in the slow tier MTP over fused-QKV attention too, RoPE and GPT-2's learned positions).

Packed documents, with and without a window, are compared with the documents run one by one at cp 1:
lengths 1 and odd, documents crossing the cp chunk edges (chunks of 4 tokens, [0, 4) and [12, 16) on rank 0),
documents starting at a rank's edge (4, 12) or just after it (13), a sample that is one document, masked
labels on both ranks. MTP's depth k drops the targets whose token i+k lies in the next document, which under
cp may sit in the other rank's chunk (tokens 2, 3 -> 4, 10, 11 -> 12 and 11 -> 13 cross from one rank to the
other), and keeps those whose document crosses the edge (sample 1: tokens 2..12) A window alone is compared with the same model at cp 1, whose window over MTP's depths
tests/model/test_mtp.py proves against the report's formulation."""
import os
import sys

import pytest
import torch

from megalite.distributed import mesh
from megalite.model import GPTModel, preset
from megalite.testing import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from packed_documents import assert_same_mtp_run, documents_batch, one_by_one, packed_run  # noqa: E402

S = 16
DOCUMENTS = ([1, 3, 8, 4], [2, 11, 3], [16])
MASKED = ((0, 2), (1, 13), (2, 6))
WINDOW = 5
MLA = dict(mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12))
MTP = dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
MODELS = {"mla+mtp": ("tiny-llama", {**MLA, **MTP}), "mtp": ("tiny-llama", MTP),
          "gpt2+mtp": ("tiny", MTP)}  # the learned position table: Emb(t_{i+k}) at token i's position
CASES = {"documents": (None, True), "window": (WINDOW, False), "documents+window": (WINDOW, True)}


def _model(name, window, m=None, comm_type="p2p"):
    flavour, settings = MODELS[name]
    cfg = preset(flavour, num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 seq_length=S, window_size=window, **settings)
    return GPTModel(cfg, m, seed=5, cp_comm_type=comm_type).train(), cfg


def _batch(vocab, documents):
    ids, labels, positions = documents_batch(vocab, DOCUMENTS, S, masked=MASKED)
    return ids, labels, (positions if documents else None)


def _expected(name, case):
    """cp 1: (logits, loss sum, each depth's summed loss, every gradient) of the documents run one by one,
    or, for a window alone, of the batch."""
    window, documents = CASES[case]
    model, cfg = _model(name, window)
    if not documents:
        return packed_run(model, *_batch(cfg.vocab_size, False))
    logits, loss, grads = one_by_one(model, DOCUMENTS, S, cfg.vocab_size, cfg.padded_vocab_size(1), masked=MASKED)
    return logits, loss, torch.tensor(model.mtp.take_step_sums(), dtype=torch.float64), grads


def _rank(name, expected):
    m = mesh.init_mesh(cp=2)
    checked = {}
    for comm_type in ("p2p", "a2a"):
        for case, reference in expected.items():
            window, documents = CASES[case]
            model, cfg = _model(name, window, m, comm_type)
            run = packed_run(model, *_batch(cfg.vocab_size, documents))
            checked[(comm_type, case)] = assert_same_mtp_run(run, reference, vocab=cfg.vocab_size,
                                                             what=f"{name} {comm_type} {case}")
    return checked


QUICK = ("window", "documents+window")  # the documents alone in the slow tier


@pytest.mark.parametrize("name, cases", [("mla+mtp", QUICK), pytest.param("mla+mtp", tuple(CASES), marks=pytest.mark.slow),
                                         pytest.param("mtp", tuple(CASES), marks=pytest.mark.slow),
                                         pytest.param("gpt2+mtp", tuple(CASES), marks=pytest.mark.slow)])
def test_deepseek_documents_and_windows_at_cp2_equal_the_single_process(name, cases):
    expected = {case: _expected(name, case) for case in cases}
    n = len(expected[cases[0]][3])
    assert all(e[2].abs().min() > 0 for e in expected.values())  # both depths have targets
    model, cfg = _model(name, None)
    unmasked = packed_run(model, *_batch(cfg.vocab_size, False))[2]
    for case in cases:  # the oracle can fail: without the mask each depth's loss differs
        assert (unmasked - expected[case][2]).abs().min() > 1e-3, case
    results = run_distributed(_rank, 2, name, expected)
    assert results == [{(t, c): n for t in ("p2p", "a2a") for c in cases}] * 2
