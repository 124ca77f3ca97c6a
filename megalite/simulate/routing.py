"""Expert parallelism in the fake world: the token counts that size the MoE all-to-all.

The all-to-all dispatcher (moe/dispatcher.py) exchanges its per-(rank, expert) route counts and
reads them on the host: they size the token all-to-all there and back. On the meta device the
counts have no value, so a simulated rank's dispatchers are handed `BalancedRoutes`
(`moe.dispatcher.use_route_counts`): the exchange still runs (the ledger counts its E int64 per
forward, as on a GPU) and its answer is the planner's assumption, `plan.moe.balanced_routes`
(dropless, balanced: each rank sends routes/ep to every ep rank, and receives as many as it sends).
The bytes the simulated rank then sends and keeps are those of a perfectly balanced router: what
the planner counts, and the figure to book a cluster with; a real run's routing follows its data
and moves more on its busiest rank.

The all-gather dispatcher gathers every ep rank's routes and permutes those to its own experts: how
many they are is a host read inside the permutation (`moe_permute.sort_by_expert`, the routed
slots). `BalancedRoutes` answers it too: every rank receives as many routes as it sends (T*k), the
rest of the ep*T*k gathered slots are other ranks'; the permutation cuts its sort there.
"""
from __future__ import annotations

import torch

from megalite.moe.dispatcher import RouteCounts
from megalite.plan.moe import balanced_routes


class BalancedRoutes(RouteCounts):
    """The planner's balanced, dropless routing in place of the counts a meta tensor does not hold."""

    def splits(self, send_counts: torch.Tensor, recv_counts: torch.Tensor, *, routes: int, ep_rank: int,
               ep_size: int, num_experts: int) -> tuple[list[int], list[int]]:
        send = [sum(balanced_routes(routes, num_experts, ep_size, ep_rank, dest)) for dest in range(ep_size)]
        recv = [sum(balanced_routes(routes, num_experts, ep_size, source, ep_rank)) for source in range(ep_size)]
        return send, recv

    def gathered_own(self, *, routes: int, ep_rank: int, ep_size: int, num_experts: int) -> int:
        return sum(sum(balanced_routes(routes, num_experts, ep_size, source, ep_rank)) for source in range(ep_size))
