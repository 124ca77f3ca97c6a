"""The router's rules on small hand-made cases: the aux loss equals a hand computation, ties go to the
lower expert, capacity drops what the policy says (and the layer reports it), weights per score
function, the expert-bias step, and the MoE settings' refusals."""
import math

import pytest
import torch

from megalite.training.launch_checks import launch_problems
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.model.gpt import GPTModel
from megalite.config.moe import MoEConfig
from megalite.moe.router import Router, capacity_keep_mask, top_k_deterministic, update_expert_bias
from megalite.moe.bookkeeping import moe_stats


def _router(logits_weight, **moe):
    e, h = logits_weight.shape
    router = Router(h, MoEConfig(num_experts=e, **moe), init_std=0.02)
    with torch.no_grad():
        router.weight.copy_(logits_weight)
    return router


def test_aux_loss_equals_a_hand_computation():
    # 3 tokens, 3 experts, k = 1; the tokens are one-hot so the logits are the router weight's columns
    weight = torch.tensor([[2.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]])  # [E, h]
    tokens = torch.eye(3)
    routing = _router(weight, topk=1)(tokens, num_sequences=1)
    logits = tokens @ weight.t()  # [T, E]: rows (2, 1, 0), (0, 0, 3), (1, 0, 0)
    p = torch.softmax(logits, -1)
    assert routing.expert_ids.view(-1).tolist() == [0, 2, 0]
    routes = [2.0, 0.0, 1.0]
    hand = 3 / (3 * 3 * 1) * sum(p[:, e].sum().item() * routes[e] for e in range(3))
    assert routing.aux_loss.item() == pytest.approx(hand, rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 3
    z_routing = _router(weight, topk=1, z_loss_coeff=1.0)(tokens, 1)
    assert z_routing.z_loss.item() == pytest.approx(z, rel=1e-6)
    # one weight per token at k = 1 with the renormalised softmax
    torch.testing.assert_close(routing.weights, torch.ones(3, 1))


def test_sequence_aux_loss_averages_the_sequences():
    torch.manual_seed(0)
    weight, tokens = torch.randn(4, 8), torch.randn(6, 8)  # [s=3, b=2] flattened
    seq = _router(weight, topk=2, load_balancing_type="seq_aux_loss")(tokens, num_sequences=2)
    per = []
    for j in range(2):  # sequence j: tokens j, j+2, j+4
        single = _router(weight, topk=2)(tokens[j::2], num_sequences=1)
        per.append(single.aux_loss)
    assert seq.aux_loss.item() == pytest.approx(sum(per).item() / 2, rel=1e-6)


def test_ties_choose_the_lower_expert_and_weights_follow_the_score_function():
    scores = torch.tensor([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    assert top_k_deterministic(scores, 2).tolist() == [[1, 2], [0, 1]]
    weight = torch.zeros(4, 2)  # every logit 0: all experts tie
    routing = _router(weight, topk=2)(torch.randn(5, 2), 1)
    assert routing.expert_ids.tolist() == [[0, 1]] * 5
    torch.testing.assert_close(routing.weights, torch.full((5, 2), 0.5))
    pre = _router(weight, topk=2, pre_softmax=True)(torch.randn(5, 2), 1)  # softmax over 4, not renormalised
    torch.testing.assert_close(pre.weights, torch.full((5, 2), 0.25))
    sig = _router(torch.tensor([[1.0], [2.0], [0.0]]), topk=2, score_function="sigmoid")(torch.ones(1, 1), 1)
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    assert sig.expert_ids.tolist() == [[1, 0]]
    torch.testing.assert_close(sig.weights, (s / s.sum()).view(1, 2))


def test_capacity_drops_by_probability_or_by_position():
    expert_ids = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])  # expert 0: 4 routes, 1: 3, 2: 1
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    by_probs = capacity_keep_mask(expert_ids, weights, 3, capacity=2, policy="probs")
    # expert 0 keeps its 2 largest weights (0.9 token 1, 0.6 token 0); expert 1 keeps 0.7 and 0.4
    assert by_probs.tolist() == [[True, True], [True, False], [False, True], [True, False]]
    by_position = capacity_keep_mask(expert_ids, weights, 3, capacity=2, policy="position")
    assert by_position.tolist() == [[True, True], [True, True], [False, True], [False, False]]


def test_a_capacity_factor_run_drops_and_reports_it():
    config = preset("moe-tiny", num_layers=1, seq_length=16,
                    moe=dict(num_experts=4, topk=2, capacity_factor=0.5, token_drop_policy="position"))
    model = GPTModel(config, single_process_mesh("cpu"))
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    routing = model.layers[0].mlp.router(model.layers[0].post_attention_norm(model.embed(ids)).reshape(32, -1), 2)
    capacity = math.ceil(0.5 * 32 * 2 / 4)
    kept = torch.bincount(routing.expert_ids[routing.expert_ids >= 0], minlength=4)
    assert kept.max().item() <= capacity
    expected_drops = sum(max(0, c - capacity) for c in routing.tokens_per_expert.tolist())
    assert routing.dropped.item() == expected_drops > 0
    model(ids, ids).backward()
    stats = moe_stats([model], single_process_mesh("cpu"))
    assert stats["moe_dropped_tokens"] > 0 and stats["moe_layers"][0]["tokens_per_expert_mean"] == 16.0


def test_expert_bias_moves_toward_the_mean_load():
    router = _router(torch.tensor([[1.0], [0.0], [0.0]]), topk=1, enable_expert_bias=True, bias_update_rate=0.1)
    routing = router(torch.ones(4, 1), 1)  # every token picks expert 0
    assert routing.expert_ids.view(-1).tolist() == [0, 0, 0, 0]
    update_expert_bias(router, None, 0.1)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1]))
    assert router.step_tokens_per_expert.sum() == 0


@pytest.mark.parametrize("settings, message", [
    (dict(moe_router_topk=2), "add --num-experts"),
    (dict(num_experts=4, moe_router_topk=5), "--moe-router-topk 5"),
    (dict(num_experts=4, moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be a finite number > 0"),
    (dict(num_experts=6, ep=4, dp=4), "not divisible by --ep 4"),
    (dict(num_experts=4, ep=4, dp=2), "--ep 4 does not divide dp*cp"),
    (dict(ep=2, dp=2), "the model has none"),
    (dict(num_experts=4, tp=2, etp=3), "--etp 3 must be 1 (whole experts on every tp rank) or --tp 2"),
    (dict(num_experts=4, tp=4, etp=2), "choose --etp 1 or --etp 4"),
])
def test_bad_moe_settings_are_refused_with_the_fix(settings, message):
    cfg = RunConfig.build(**settings)
    world = settings.get("dp", 1) * settings.get("tp", 1)
    problems = launch_problems(cfg.resolved(world), world)
    assert any(message in p for p in problems), problems


def test_whole_experts_under_tp_take_a_sequence_tp_does_not_divide():
    # etp 1 without SP: the tp ranks route 8 and 7 of 15 rows (tests/moe/test_moe_uneven.py); SP splits the
    # whole sequence and keeps its own rule
    assert launch_problems(RunConfig.build(num_experts=4, tp=2, seq_length=15).resolved(2), 2) == []
    problems = launch_problems(RunConfig.build(num_experts=4, tp=2, seq_length=15, sequence_parallel=True)
                               .resolved(2), 2)
    assert any("seq_length=15 is not divisible by tp=2" in p for p in problems), problems
