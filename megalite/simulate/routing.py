"""Expert parallelism in the fake world: the token counts that size the MoE all-to-all.

The all-to-all dispatcher (moe/dispatcher.py) exchanges its per-(rank, expert) route counts and
reads them on the host: they size the token all-to-all there and back. On the meta device the
counts have no value, so inside `planned_routing()` the exchange still runs (the ledger counts its
E int64 per forward, as on a GPU) and its answer is the planner's assumption,
`plan.moe.balanced_routes` (dropless, balanced: each rank sends routes/ep to every ep rank, and
receives as many as it sends). The bytes the simulated rank then sends and keeps are those of a
perfectly balanced router: what the planner counts, and the figure to book a cluster with; a
real run's routing follows its data and moves more on its busiest rank.

The all-gather dispatcher's routed rows are a host read inside the permutation kernel (how many
gathered routes are this rank's): not answered here, so `--simulate` refuses it at ep > 1.
"""
from __future__ import annotations

import contextlib

import torch

from megalite import comm
from megalite.moe.dispatcher import AllToAllDispatcher
from megalite.plan.moe import balanced_routes


def planned_counts(dispatcher: AllToAllDispatcher, send_counts: torch.Tensor, routes: int):
    """AllToAllDispatcher.exchange_counts in the fake world: the same collective, the planner's counts.
    send_counts [ep, local] (meta) -> (recv_counts [ep, local] (meta: only its shape is read),
    send_splits, recv_splits)."""
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all(recv_counts, send_counts.contiguous(), dispatcher.ep_group)
    ep, me, experts = dispatcher.ep_size, dispatcher.ep_rank, dispatcher.num_experts
    send_splits = [sum(balanced_routes(routes, experts, ep, me, dest)) for dest in range(ep)]
    recv_splits = [sum(balanced_routes(routes, experts, ep, source, me)) for source in range(ep)]
    return recv_counts, send_splits, recv_splits


@contextlib.contextmanager
def planned_routing():
    """Every AllToAllDispatcher's count exchange answered with the planner's balanced counts until
    the block ends (the method is put back after)."""
    saved = AllToAllDispatcher.exchange_counts
    AllToAllDispatcher.exchange_counts = planned_counts
    try:
        yield
    finally:
        AllToAllDispatcher.exchange_counts = saved
