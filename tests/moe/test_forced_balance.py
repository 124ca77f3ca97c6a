"""--moe-router-force-load-balancing: the router's routes are the planner's balanced routing
(plan.moe.balanced_routes), whatever its scores choose; each token's k experts differ."""
import pytest
import torch

from megalite.config import RunConfig
from megalite.config.moe import MoEConfig
from megalite.moe.router import Router, balanced_expert_ids
from megalite.plan.moe import balanced_routes


@pytest.mark.parametrize("tokens,k,experts,ep,rank", [(16, 2, 8, 2, 0), (7, 2, 4, 2, 1), (5, 3, 4, 1, 0),
                                                      (9, 2, 6, 3, 2), (3, 4, 4, 4, 3)])
def test_balanced_ids_count_what_the_planner_counts(tokens, k, experts, ep, rank):
    ids = balanced_expert_ids(tokens, k, experts, ep, rank, "cpu")
    assert ids.shape == (tokens, k)
    assert all(len(set(row)) == k for row in ids.tolist())  # a token never routes twice to one expert
    planned = [n for dest in range(ep) for n in balanced_routes(tokens * k, experts, ep, rank, dest)]
    assert torch.bincount(ids.reshape(-1), minlength=experts).tolist() == planned


def test_the_forced_router_ignores_the_scores_choice_and_keeps_their_weights():
    moe = MoEConfig(num_experts=4, topk=2, force_load_balancing=True)
    router = Router(8, moe, 0.02, ep_place=(1, 2))
    tokens = torch.randn(6, 8)
    routing = router(tokens, 1)
    assert torch.equal(routing.expert_ids, balanced_expert_ids(6, 2, 4, 2, 1, "cpu"))
    logits = tokens @ router.weight.t()
    torch.testing.assert_close(routing.weights, torch.softmax(logits.gather(1, routing.expert_ids), -1))
    assert routing.tokens_per_expert.tolist() == [3, 3, 3, 3]


def test_the_flag_reaches_the_model():
    cfg = RunConfig.build(model="moe-tiny", moe_router_force_load_balancing=True)
    assert cfg.gpt_config().moe.force_load_balancing
    assert not RunConfig.build(model="moe-tiny").gpt_config().moe.force_load_balancing
