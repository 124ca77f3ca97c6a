"""DeepSeek's pieces under the per-document cp split (cp_split="documents"; context_parallel/document_split.py)
at cp 2 equal the single process on the same packed batch: logits, the loss sum, each MTP depth's summed loss
and every gradient, float32, 1e-5.

- MoE (4 experts, top 2, the load-balancing and z losses in the gradient; the per-sequence balancing loss
  in the slow tier): routing is per token and the losses are sums over a sequence's tokens, whichever rank
  holds them, so the split's token order does not change them. A capacity factor decides its drops in the
  single process's token order (both drop policies; routes are dropped): each rank hands the router its
  tokens' places in it from the split's order (moe/layer.py `_token_order`);
- latent attention (d_qk 16 != d_v 12) through the split's ring calls and Ulysses;
- MTP (two depths): the whole sequence's ids and labels gathered and cut back by the split's order, depth k's
  target dropped where token i+k lies in the next document (on either rank).

The single process with packed documents equals the documents run one by one (tests/model/test_mla_documents.py,
test_mtp.py, test_deepseek_documents_cp.py); with an MoE the balancing losses are the batch's, so the
single process is the oracle. Lengths 1 and odd (their ends dealt as one zigzag sequence), a document
crossing the zigzag chunk edge (11 tokens from 2), multiples of 2cp, a sample that is one document, masked
labels.
"""
import os
import sys

import pytest

from megalite.distributed import mesh
from megalite.model import GPTModel, preset
from megalite.testing import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from packed_documents import assert_same_mtp_run, documents_batch, packed_run  # noqa: E402

S = 16
DOCUMENTS = ([1, 5, 3, 7], [2, 11, 3], [16])
MASKED = ((0, 2), (1, 13), (2, 6))
MOE = dict(moe=dict(num_experts=4, topk=2, ffn_hidden_size=16, aux_loss_coeff=1e-2, z_loss_coeff=1e-3))
SEQ_MOE = dict(moe=dict(num_experts=4, topk=2, ffn_hidden_size=16, aux_loss_coeff=1e-2,
                        load_balancing_type="seq_aux_loss"))
CAPACITY = {policy: dict(moe=dict(num_experts=4, topk=2, ffn_hidden_size=16, capacity_factor=0.5,
                                  token_drop_policy=policy)) for policy in ("probs", "position")}
MLA = dict(mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12))
MTP = dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
MODELS = {"moe": MOE, "seq-moe": SEQ_MOE, "mla": MLA, "mtp": MTP, "mla+mtp+moe": {**MLA, **MTP, **MOE},
          "capacity": CAPACITY["position"], "capacity-probs": CAPACITY["probs"]}


def _model(name, m=None, comm_type="p2p", split="zigzag"):
    cfg = preset("tiny-llama", num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 seq_length=S, **MODELS[name])
    return GPTModel(cfg, m, seed=5, cp_comm_type=comm_type, cp_split=split).train(), cfg


def _run(model, cfg):
    return packed_run(model, *documents_batch(cfg.vocab_size, DOCUMENTS, S, masked=MASKED))


def _rank(cases, expected):
    m = mesh.init_mesh(cp=2)
    checked = {}
    for name, comm_type in cases:
        model, cfg = _model(name, m, comm_type, split="documents")
        checked[(name, comm_type)] = assert_same_mtp_run(_run(model, cfg), expected[name], vocab=cfg.vocab_size,
                                                         what=f"{name} {comm_type}")
    return checked


@pytest.mark.parametrize("cases", [
    (("mla+mtp+moe", "p2p"), ("capacity", "p2p")),  # quick: the three together, and dropped routes
    pytest.param((("moe", "p2p"), ("moe", "a2a"), ("seq-moe", "p2p"), ("mla", "p2p"), ("mla", "a2a"), ("mtp", "p2p"),
                  ("mtp", "a2a"), ("mla+mtp+moe", "a2a"), ("capacity-probs", "a2a")), marks=pytest.mark.slow)])
def test_deepseek_pieces_under_the_document_split_equal_the_single_process(cases):
    names = {name for name, _ in cases}
    expected = {name: _run(*_model(name)) for name in names}
    for name in names & {"mtp", "mla+mtp+moe"}:  # the oracle can fail: without documents each depth's loss differs
        model, cfg = _model(name)
        ids, labels, _ = documents_batch(cfg.vocab_size, DOCUMENTS, S, masked=MASKED)
        unmasked = packed_run(model, ids, labels, None)[2]
        assert expected[name][2].abs().min() > 0 and (unmasked - expected[name][2]).abs().min() > 1e-3, name
    for name in names & {"capacity", "capacity-probs"}:  # the oracle can fail: routes are dropped
        model, cfg = _model(name)
        _run(model, cfg)
        assert int(model.layers[0].mlp.stats["dropped"]) > 0, name
    results = run_distributed(_rank, 2, cases, expected)
    assert results == [{(name, t): len(expected[name][3]) for name, t in cases}] * 2

