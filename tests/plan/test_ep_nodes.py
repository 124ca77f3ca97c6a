"""The planner's nodes of the expert-parallel dispatch (megalite/plan/ep_nodes.py): at DeepSeek-V3's layout
(ep 64 on 8-GPU nodes, 8 groups, group top-k 4) megalite's per-route all-to-all sends 7 of a token's 8 routes
off its node, a once-per-node dispatch 3.5 token copies, never more than 4 nodes; the router's own
group-limited choice keeps every token inside group-top-k nodes; the probabilities equal an enumeration."""
import itertools
import math

import torch

from megalite.config import RunConfig
from megalite.moe.router import group_limited_selection, top_k_deterministic
from megalite.plan.ep_nodes import ep_node_traffic, node_visit_probability
from megalite.plan.moe import dispatch_bytes

V3 = dict(model="deepseek-v3", pp=16, ep=64, dp=128, zero=1, micro_batch_size=1, global_batch_size=4096,
          precision="bf16", pipeline_layout="4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,1")


def test_deepseek_v3_layout_bounds_a_token_to_group_topk_nodes():
    cfg = RunConfig.build(**V3).resolved(2048)
    model = cfg.gpt_config()
    traffic = ep_node_traffic(model, cfg, stage=1, ranks_per_node=8)
    counts = 8 * model.moe.num_experts * cfg.num_microbatches * 4  # the count exchange: 4 MoE blocks, one forward
    assert traffic.route_bytes == dispatch_bytes(model, cfg, 1)["ep/all_to_all"] - counts
    assert (traffic.nodes, traffic.max_nodes_per_token) == (8, 4)
    assert traffic.inter_node_bytes == traffic.route_bytes * 7 // 8  # every route alone: k (N-1)/N of them
    assert traffic.per_node_inter_node_bytes == traffic.route_bytes * 3.5 / 8  # (N-1)(1 - C(7,4)/C(8,4)) copies
    ungrouped = model.replace(moe=model.moe.replace(num_groups=None, group_topk=None))
    unbounded = ep_node_traffic(ungrouped, cfg, stage=1, ranks_per_node=8)
    assert unbounded.inter_node_bytes == traffic.inter_node_bytes  # the per-route all-to-all gains nothing
    assert unbounded.max_nodes_per_token == 8
    assert 4.6 * 8 < 64 * unbounded.per_node_inter_node_bytes / unbounded.route_bytes < 4.7 * 8
    assert ep_node_traffic(model, cfg, stage=0, ranks_per_node=8).nodes == 8
    assert ep_node_traffic(model, cfg.replace(ep=8), stage=1, ranks_per_node=8).per_node_inter_node_bytes == 0


def test_node_visit_probability_equals_an_enumeration():
    """Every choice of M groups alike (balanced): the share of them touching node 0's q groups."""
    cfg = RunConfig.build(model="deepseek-tiny")  # 8 experts in 4 groups, group top-k 2
    model = cfg.gpt_config()
    for nodes in (2, 4):
        per_node = 4 // nodes
        subsets = list(itertools.combinations(range(4), 2))
        visits = sum(any(g < per_node for g in s) for s in subsets) / len(subsets)
        assert math.isclose(node_visit_probability(model, nodes), visits)


def test_the_router_keeps_each_token_inside_group_topk_nodes():
    """megalite's own group-limited top-k (random scores, 64 experts in 8 groups, top-k 8 of 4 groups): the
    experts of every token sit on at most 4 of the 8 nodes (ep 16, 2 ranks per node, 4 experts per rank)."""
    model = RunConfig.build(model="deepseek-tiny", num_experts=64, moe_router_num_groups=8, moe_router_group_topk=4,
                            moe_router_topk=8).gpt_config()
    scores = torch.rand(4096, 64, generator=torch.Generator().manual_seed(0))
    chosen = top_k_deterministic(group_limited_selection(scores, model.moe), 8)  # [T, k] expert ids
    nodes = chosen // 8  # 64 experts over 8 nodes: 8 consecutive experts on each
    visited = torch.tensor([len(set(row.tolist())) for row in nodes])
    assert int(visited.max()) == 4 and int(visited.min()) >= 2
    off_node = (nodes != 0).float().sum(1).mean()  # a token on node 0: its routes that leave
    assert 0.8 < float(off_node) / (8 * 7 / 8) < 1.2  # random scores are near balance: about k(N-1)/N
