"""Which of the expert-parallel dispatch's bytes cross nodes, and the bound group-limited routing puts on it.

Pure arithmetic. The ep ranks of a group sit tp apart in the rank order (tp -> cp -> dp -> pp, ep folded
into dp x cp), so with R ranks per node an ep group of `ep` ranks spans N = ep*tp / R nodes (one when it
fits), ep/N ranks on each; experts are consecutive per ep rank, so node j holds experts
[j*E/N, (j+1)*E/N). Under the planner's balanced routing (plan/moe.py, `balanced_routes`) a route lands on
every ep rank alike, so of a token's k routes k(N-1)/N leave its node, whatever the router.

Group-limited routing (`--moe-router-num-groups G`, `--moe-router-group-topk M`: DeepSeek-V3's n_group 8,
topk_group 4) picks M of the G expert groups first; with the groups laid along the nodes (G a multiple
of N, q = G/N groups on each node) a token reaches at most M nodes. That bound shrinks what crosses nodes
only for a dispatch that sends a token once per node it visits and fans it out inside the node (DeepSeek's
own, DeepEP's): per token sum over the other nodes of P(the node is visited) = (N-1) p, with p =
1 - C(G-q, M) / C(G, M) the chance that a given node holds one of its M groups (balanced: every M-subset
alike); without groups p = 1 - C(E - E/N, k) / C(E, k) for its k distinct experts. megalite's all-to-all
sends every route on its own (moe/dispatcher.py), so its inter-node bytes are the k(N-1)/N share: the
bound does not lower them, and the per-node figure says what a deduplicating transport would save.

For DeepSeek-V3 at ep 64 on 8-GPU nodes (N = 8, G = 8, q = 1, M = 4, k = 8): k(N-1)/N = 7 routes per token
cross nodes as megalite sends them; once per node with the group bound 7 * (1 - 35/70) = 3.5 (never more
than M = 4); once per node without it 7 * (1 - C(224, 8)/C(256, 8)) = 4.6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.choices import MoEDispatcher
from megalite.config.model import GPTConfig
from megalite.plan.layout import DTYPE_BYTES
from megalite.plan.moe import routed_tokens, stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class EpNodeTraffic:
    """One rank's expert-parallel token traffic per step (dispatch and combine, forward and backward)."""

    nodes: int  # N: nodes the ep group spans
    max_nodes_per_token: int  # nodes a token's routes can reach: min(N, M * nodes per group) or N
    route_bytes: int  # the token rows megalite's all-to-all moves (its own rows included)
    inter_node_bytes: int  # of those, rows to ranks on other nodes: the k(N-1)/N share
    per_node_inter_node_bytes: int  # a token sent once per other node it visits (the bound applies here)


def ep_nodes(cfg: RunConfig, ranks_per_node: int) -> int:
    """N: nodes one ep group spans (its ranks tp apart in the rank order)."""
    span = cfg.parallel.ep * cfg.parallel.tp
    return max(1, span // ranks_per_node) if span > ranks_per_node else 1


def node_visit_probability(model: GPTConfig, nodes: int) -> float:
    """p: the chance that a token's routes reach a given node (module docstring), balanced routing."""
    moe = model.moe
    if moe.num_groups is not None and moe.group_topk is not None and moe.num_groups % nodes == 0:
        per_node = moe.num_groups // nodes  # groups laid along the nodes: q on each
        return 1 - math.comb(moe.num_groups - per_node, moe.group_topk) / math.comb(moe.num_groups, moe.group_topk)
    experts = moe.num_experts
    return 1 - math.comb(experts - experts // nodes, moe.topk) / math.comb(experts, moe.topk)


def max_nodes_per_token(model: GPTConfig, nodes: int) -> int:
    """The most nodes one token's routes reach: M groups' nodes when the groups are laid along the nodes."""
    moe = model.moe
    if moe.num_groups is not None and moe.group_topk is not None and moe.num_groups % nodes == 0:
        return min(nodes, moe.group_topk)
    if moe.num_groups is not None and moe.group_topk is not None and nodes % moe.num_groups == 0:
        return min(nodes, moe.group_topk * nodes // moe.num_groups)  # a group spans nodes/G nodes
    return min(nodes, moe.topk)


def ep_node_traffic(model: GPTConfig, cfg: RunConfig, stage: int, ranks_per_node: int) -> EpNodeTraffic | None:
    """The ep all-to-all's token rows per step on a rank of `stage`, and the share crossing nodes (None
    without expert parallelism or MoE blocks on the stage, or under the all-gather dispatcher)."""
    layers, ep = stage_moe_layers(model, cfg, stage), cfg.parallel.ep
    if not layers or ep == 1 or cfg.parallel.moe_token_dispatcher_type != MoEDispatcher.ALLTOALL:
        return None
    nodes = ep_nodes(cfg, ranks_per_node)
    m, a, h, k = cfg.num_microbatches, DTYPE_BYTES[cfg.precision.precision], model.hidden_size, model.moe.topk
    passes = m * (2 * layers + stage_moe_layers(model, cfg, stage, recomputed=True))  # fwd, bwd, re-run fwd
    tokens = routed_tokens(model, cfg)
    row_bytes = passes * 2 * tokens * h * a  # dispatch and combine, each a token row per route
    per_node = (nodes - 1) * node_visit_probability(model, nodes) if nodes > 1 else 0.0
    return EpNodeTraffic(nodes=nodes, max_nodes_per_token=max_nodes_per_token(model, nodes),
                         route_bytes=row_bytes * k, inter_node_bytes=row_bytes * k * (nodes - 1) // nodes,
                         per_node_inter_node_bytes=round(row_bytes * per_node))


def describe(traffic: EpNodeTraffic) -> str:
    """One line for a report: what crosses nodes as megalite sends it, and once per node."""
    gb = 1e9
    return (f"ep dispatch/combine across {traffic.nodes} nodes: {traffic.inter_node_bytes / gb:.3f} of "
            f"{traffic.route_bytes / gb:.3f} GB/step leave the node (every route sent alone); sent once per node "
            f"{traffic.per_node_inter_node_bytes / gb:.3f} GB (a token reaches at most "
            f"{traffic.max_nodes_per_token} nodes)")
