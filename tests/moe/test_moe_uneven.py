"""MoE at etp 1 on a token count tp does not divide: each tp rank routes split_sizes(s, tp) rows (21 tokens
over tp 2: 11 and 10), the rows travel by the uneven all-gather / reduce-scatter of
megalite/distributed/uneven.py, and the model is the single process's.

Quick tier: the uneven collectives against a hand-made answer (2 ranks); the tiny MoE model with both
balancing losses, a capacity factor and a shared expert at (tp 2, etp 1, no SP) against the single process
(loss and every gradient, 2 ranks). Slow tier: transformers' Mixtral at (tp 2, ep 2, etp 1) against transformers
on 21 tokens: logits, loss and every gradient (4 ranks, each dp rank one of the two sequences).
"""
import os
import sys

import pytest
import torch

from megalite.distributed import comm, mesh, uneven
from megalite.distributed.mesh import destroy_mesh, single_process_mesh
from megalite.parameters import params as P
from megalite.testing import run_distributed
from megalite.training.step import build_model_chunks
from moe_helpers import cfg_for

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "model"))
import hf_families as H  # noqa: E402

from megalite.model import from_hf  # noqa: E402
from megalite.model.hf import config_from_hf, hf_to_full_state  # noqa: E402

TOKENS = 21  # tp 2 does not divide it: 11 + 10 rows


def test_split_sizes_are_as_even_as_they_go():
    assert uneven.split_sizes(21, 2) == [11, 10]
    assert uneven.split_sizes(22, 4) == [6, 6, 5, 5]
    assert uneven.split_sizes(3, 4) == [1, 1, 1, 0]
    assert uneven.split_sizes(8, 2) == [4, 4]
    with pytest.raises(ValueError, match="cannot split 5 rows over 0 ranks"):
        uneven.split_sizes(5, 0)


def _collectives():
    group = mesh.init_mesh(tp=2).tp_group
    rank, sizes = comm.group_rank(group), [3, 2]
    full = torch.arange(10.0).view(5, 2) * (rank + 1)  # each rank's partial sums of [5, 2]
    mine = uneven.reduce_scatter(full, group, sizes)  # rows 0-2 on rank 0, 3-4 on rank 1, summed (x1 + x2)
    gathered = uneven.all_gather(mine, group, sizes)
    with pytest.raises(ValueError, match=f"rank {rank} holds 4 rows, its piece is {2 + rank}"):  # before the wire
        uneven.all_gather(torch.zeros(4, 2), group, [2, 3])
    return mine, gathered, dict(comm.ledger.bytes)


def test_uneven_collectives_give_each_rank_its_rows():
    whole = torch.arange(10.0).view(5, 2) * 3
    for rank, (mine, gathered, ledger) in enumerate(run_distributed(_collectives, 2, timeout_s=60)):
        assert torch.equal(mine, whole[:3] if rank == 0 else whole[3:])
        assert torch.equal(gathered, whole)
        # on the wire each piece is padded to 3 rows: [6, 2] float32 in and out
        assert ledger[("tp", "reduce_scatter")] == ledger[("tp", "all_gather")] == 6 * 2 * 4


# --- the tiny MoE model, every balancing term, at (tp 2, etp 1, no SP) ----------------------------------


SETTINGS = dict(num_layers=1, seq_length=32, moe_expert_capacity_factor=0.75, moe_shared_expert_intermediate_size=32,
                moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2)


def _ids(tokens):
    return torch.randint(0, 257, (2, tokens + 1), generator=torch.Generator().manual_seed(5))


def _loss_and_grads(m, cfg, tokens):
    """The model's summed loss on `tokens` tokens, {logical name: this rank's gradient} (summed where each tp rank's
    tokens gave part of it: the router and, at etp 1, the experts) and the routes its capacity dropped."""
    torch.manual_seed(3)
    model = build_model_chunks(cfg.gpt_config(), cfg, m)[0]
    ids = _ids(tokens)
    loss = model(ids[:, :-1], ids[:, 1:], reduction="sum")
    loss.backward()
    grads = {}
    for name, param in model.logical_parameters():
        grad = param.grad
        if P.is_sequence_parallel_grad(param):
            grad = comm.all_reduce(grad.clone(), m.tp_group)
        if P.info(param).expert_parallel and m.experts_whole:
            grad = comm.all_reduce(grad.clone(), m.expert_dp_group)
        grads[name] = (P.shard_spec(param), grad)
    return loss.detach(), grads, int(model.layers[0].mlp.stats["dropped"])


def _tiny_at_tp2(reference, tokens):
    cfg = cfg_for(tp=2, **SETTINGS)
    m = mesh.init_mesh(layout=cfg.layout())
    ref_loss, ref_grads, _ = reference
    try:
        loss, grads, dropped = _loss_and_grads(m, cfg, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for name, (spec, grad) in grads.items():
            torch.testing.assert_close(grad, spec.shard(ref_grads[name]), rtol=1e-5, atol=1e-6, msg=name)
        return sorted(grads), int(comm.all_reduce(torch.tensor(dropped), m.tp_group))
    finally:
        destroy_mesh()


@pytest.mark.parametrize("tokens", [TOKENS, 1])  # 1: tp rank 1 routes no row at all
def test_tiny_moe_at_etp1_on_a_token_count_tp_does_not_divide_equals_the_single_process(tokens):
    cfg = cfg_for(**SETTINGS)
    loss, grads, dropped = _loss_and_grads(single_process_mesh("cpu"), cfg, tokens)
    reference = (loss, {name: spec.assemble([grad]) for name, (spec, grad) in grads.items()}, dropped)
    assert dropped > 0 or tokens == 1  # the capacity bites: the drops are decided over both tp ranks' rows together
    for names, rank_dropped in run_distributed(_tiny_at_tp2, 2, reference, tokens, timeout_s=120):
        assert names == sorted(grads) and rank_dropped == dropped


# --- transformers' Mixtral at (tp 2, ep 2, etp 1) on 21 tokens --------------------------------------------


def _mixtral_reference():
    """(hf model, logits [b, 21, V], mean loss, {HF name: grad})."""
    hf = H.hf_model("mixtral")
    ids = H.inputs()[:, :TOKENS]
    logits = hf(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, H.VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return hf, logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in hf.named_parameters()}


def _mixtral_at(tp, ep, hf, logits, loss, hf_grads):
    """Each dp rank runs one of the two sequences; the experts see both dp ranks' routes (ep = dp 2)."""
    m = mesh.init_mesh(tp=tp, ep=ep, etp=1, num_experts=4)
    try:
        model = from_hf(hf, m)
        mine = slice(m.dp_rank, m.dp_rank + 1) if m.dp_size == 2 else slice(0, 2)
        ids = H.inputs()[mine, :TOKENS]
        with torch.no_grad():
            full = comm.all_gather(model.eval()(ids).contiguous(), m.tp_group, dim=-1)[..., :H.VOCAB]
        torch.testing.assert_close(full, logits[mine], rtol=1e-5, atol=2e-5)
        # each dp rank's mean over its 20 targets; the step's loss and gradients: their mean over dp
        local = model.train()(ids, H.megalite_labels(ids)) / m.dp_size
        local.backward()
        torch.testing.assert_close(comm.all_reduce(local.detach().clone(), m.dp_group), loss, rtol=1e-5, atol=0)
        expected, checked = hf_to_full_state(hf_grads, config_from_hf(hf.config)), []
        for name, param in model.logical_parameters():
            grad = param.grad
            if P.is_sequence_parallel_grad(param):  # the router: each tp rank's rows give part
                grad = comm.all_reduce(grad.clone(), m.tp_group)
            if P.info(param).expert_parallel:  # each tp rank's replica of the expert saw its own rows
                grad = comm.all_reduce(grad.clone(), m.expert_dp_group)
            else:  # the dense weights: each dp rank's sequence gave part
                grad = comm.all_reduce(grad.clone(), m.dp_group)
            torch.testing.assert_close(grad, P.shard_spec(param).shard(expected[name]), rtol=1e-4, atol=1e-6,
                                       msg=name)
            checked.append(name)
        return checked
    finally:
        destroy_mesh()


@pytest.mark.slow  # ~5 s: a 4-rank world; the tiny model's test above is the quick tier's proof
def test_mixtral_at_tp2_ep2_etp1_equals_transformers_on_21_tokens():
    hf, logits, loss, grads = _mixtral_reference()
    ranks = run_distributed(_mixtral_at, 4, 2, 2, hf, logits, loss, grads, timeout_s=180)
    # every expert's gradients were compared on the ep rank holding it
    names = set().union(*ranks)
    assert {n for n in names if ".experts." in n} == {f"layers.{layer}.mlp.experts.{e}.{w}" for layer in range(2)
                                                      for e in range(4) for w in ("fc1_weight", "fc2_weight")}
