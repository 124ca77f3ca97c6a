"""Expert parallelism in the fake world: the token counts that size the MoE all-to-all.

The all-to-all dispatcher (moe/dispatcher.py) exchanges its per-(rank, expert) route counts and
reads them on the host: they size the token all-to-all there and back. On the meta device the
counts have no value, so inside `planned_routing()` the exchange still runs (the ledger counts its
E int64 per forward, as on a GPU) and its answer is the planner's assumption,
`plan.moe.balanced_routes` (dropless, balanced: each rank sends routes/ep to every ep rank, and
receives as many as it sends). The bytes the simulated rank then sends and keeps are those of a
perfectly balanced router: what the planner counts, and the figure to book a cluster with; a
real run's routing follows its data and moves more on its busiest rank.

The all-gather dispatcher gathers every ep rank's routes and permutes those to its own experts: how
many they are is a host read inside the permutation (`moe_permute.sort_by_expert`, the routed slots).
Inside `planned_routing()` that count is the balanced routing's too: every rank receives as many
routes as it sends (T*k), the rest of the ep*T*k gathered slots are other ranks'. The sort's index
is cut there, a view of the same storage, as the real code cuts it.
"""
from __future__ import annotations

import contextlib

import torch

from megalite import comm
from megalite.kernels import moe_permute
from megalite.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
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


_GATHER_DISPATCH = AllGatherDispatcher.dispatch


def planned_gather_dispatch(dispatcher: AllGatherDispatcher, tokens: torch.Tensor, expert_ids: torch.Tensor):
    """AllGatherDispatcher.dispatch in the fake world: the real one, with the number of gathered routes
    that are this rank's (a host read in the permutation) the balanced routing's."""
    ep, me, experts = dispatcher.ep_size, dispatcher.ep_rank, dispatcher.num_experts
    routes = expert_ids.numel()  # T*k, the same on every ep rank
    mine = sum(sum(balanced_routes(routes, experts, ep, source, me)) for source in range(ep))
    sort = moe_permute.sort_by_expert

    def planned_sort(ids: torch.Tensor, num_experts: int):
        order, group_sizes = sort(ids, num_experts)  # a meta read answers "none dropped": every slot
        return order[:mine], group_sizes

    with _patched(moe_permute, "sort_by_expert", planned_sort):
        return _GATHER_DISPATCH(dispatcher, tokens, expert_ids)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def planned_routing():
    """Every AllToAllDispatcher's count exchange, and every AllGatherDispatcher's count of its own routes,
    answered with the planner's balanced routing until the block ends (the methods are put back after)."""
    with _patched(AllToAllDispatcher, "exchange_counts", planned_counts), \
            _patched(AllGatherDispatcher, "dispatch", planned_gather_dispatch):
        yield
