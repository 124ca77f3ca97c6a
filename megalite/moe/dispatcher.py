"""Token dispatch: tokens to the ranks holding their experts, and the experts' outputs back.

    expert_input, group_sizes, state = dispatcher.dispatch(tokens, expert_ids)
    #   tokens [T, h], expert_ids [T, k] (global experts; -1 not routed)
    #   -> expert_input [R_local, h] sorted by this rank's local expert, group_sizes [E_local]
    output = dispatcher.combine(expert_output, weights, state)   # [R_local, h] -> [T, h]

Ep rank r holds experts [r*E/ep, (r+1)*E/ep). Two strategies (Megatron's
--moe-token-dispatcher-type), every transfer through `comm` and its byte ledger:

- alltoall (default): permute the routes by expert ([T, h] -> [T*k, h] sorted by expert, so the rows
  for each rank are contiguous), exchange the per-(rank, expert) counts, then one all-to-all with
  per-rank counts there and one back. Each rank sends only its own routes: T*k*h per layer and way.
- allgather: all-gather every ep rank's tokens, routes and weights ([ep*T, h]); each rank runs the
  routes to its experts, combines them with their weights into [ep*T, h] and a reduce-scatter
  sums the experts' contributions back onto each rank's tokens. Simpler; ep*T*h per way.

The counts are read on the host to size the all-to-all (as in Megatron): one sync per MoE layer.
How a dispatcher learns them is its `route_counts` (a `RouteCounts`: read from the router's output);
--simulate, whose tensors hold no values, hands every dispatcher the planner's balanced counts
(megalite/simulate/routing.py) through `use_route_counts`.
"""
from __future__ import annotations

import torch

from megalite.config.choices import MoEDispatcher
from megalite import ops
from megalite.distributed import comm
from megalite.distributed.layer_groups import LayerGroups
from megalite.config.moe import MoEConfig
from megalite.tensor_parallel import mappings


class _AllToAllVariable(torch.autograd.Function):
    """Forward: rows input_splits[i] to ep rank i, output_splits[i] rows from it. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        return comm.all_to_all_variable(out, x.contiguous(), output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        return comm.all_to_all_variable(out, grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


class RouteCounts:
    """The route counts that size a dispatcher's transfers, read on the host from the routing itself.

    Asked by the dispatchers with this rank's place: `ep_rank` of `ep_size` ranks, `num_experts` in all
    (E/ep on each rank), `routes` the rows this rank sends (T*k)."""

    def splits(self, send_counts: torch.Tensor, recv_counts: torch.Tensor, *, routes: int, ep_rank: int,
               ep_size: int, num_experts: int) -> tuple[list[int], list[int]]:
        """send_counts [destination rank, its local expert], recv_counts [source rank, my local expert]
        (int64) -> (rows to each ep rank, rows from each): one host read."""
        counts = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        return counts[0], counts[1]

    def gathered_own(self, *, routes: int, ep_rank: int, ep_size: int, num_experts: int) -> int | None:
        """Of the ep*T*k slots every ep rank gathered, how many route to this rank's experts; None: the
        permutation counts them (its host read, moe_permute.sort_by_expert)."""
        return None


READ_ON_HOST = RouteCounts()


class AllToAllDispatcher:
    """moe: the layer's MoEConfig (its num_experts); groups: the LayerGroups it talks over (groups.ep);
    route_counts: how the per-rank counts are learnt (default: read on the host)."""

    def __init__(self, moe: MoEConfig, groups: LayerGroups, route_counts: RouteCounts = READ_ON_HOST):
        self.num_experts, self.ep_group, self.route_counts = moe.num_experts, groups.ep, route_counts
        self.ep_size, self.ep_rank = comm.group_size(groups.ep), comm.group_rank(groups.ep)
        self.local_experts = moe.num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        permuted, sorted_index, group_sizes = ops.permute_tokens(tokens, expert_ids, self.num_experts)  # [R, h]
        if self.ep_size == 1:
            return permuted, group_sizes, (tokens.shape[0], sorted_index, None)
        ep, local = self.ep_size, self.local_experts
        recv_counts, send_splits, recv_splits = self.exchange_counts(group_sizes.view(ep, local), permuted.shape[0])
        received = _AllToAllVariable.apply(permuted, recv_splits, send_splits, self.ep_group)  # source-major
        # [source, expert] blocks -> [expert, source] blocks: rows of one local expert together
        block_of_row = torch.repeat_interleave(
            (torch.arange(local, device=tokens.device).view(1, local) * ep
             + torch.arange(ep, device=tokens.device).view(ep, 1)).reshape(-1), recv_counts.reshape(-1),
            output_size=sum(recv_splits))
        order = torch.sort(block_of_row, stable=True).indices
        state = (tokens.shape[0], sorted_index, (order, send_splits, recv_splits))
        return received[order], recv_counts.sum(0), state

    def exchange_counts(self, send_counts: torch.Tensor, routes: int):
        """send_counts [destination rank, its local expert] (int64) -> (recv_counts [source rank, my
        local expert], send_splits, recv_splits: rows to / from each ep rank, read on the host).
        routes: the rows this rank sends (= send_counts.sum()); the one fact a simulated rank (meta
        tensors, no counts) answers from (megalite/simulate/routing.py)."""
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all(recv_counts, send_counts.contiguous(), self.ep_group)
        send_splits, recv_splits = self.route_counts.splits(send_counts, recv_counts, routes=routes,
                                                            ep_rank=self.ep_rank, ep_size=self.ep_size,
                                                            num_experts=self.num_experts)
        return recv_counts, send_splits, recv_splits

    def combine(self, expert_output: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        num_tokens, sorted_index, exchange = state
        if exchange is not None:
            order, send_splits, recv_splits = exchange
            source_major = expert_output[torch.argsort(order)]
            expert_output = _AllToAllVariable.apply(source_major, send_splits, recv_splits, self.ep_group)
        return ops.unpermute_tokens(expert_output, sorted_index, weights.to(expert_output.dtype), num_tokens)


class AllGatherDispatcher:
    """moe: the layer's MoEConfig (its num_experts); groups: the LayerGroups it talks over (groups.ep);
    route_counts: how the number of gathered routes to this rank's experts is learnt (default: counted)."""

    def __init__(self, moe: MoEConfig, groups: LayerGroups, route_counts: RouteCounts = READ_ON_HOST):
        self.num_experts, self.ep_group, self.route_counts = moe.num_experts, groups.ep, route_counts
        self.ep_size, self.ep_rank = comm.group_size(groups.ep), comm.group_rank(groups.ep)
        self.local_experts = moe.num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        # [T, h] -> [ep*T, h]; backward: the gradients of every rank's copy summed onto its owner
        gathered = mappings.gather_from_sequence_parallel_region(tokens, self.ep_group)
        all_ids = comm.all_gather(expert_ids.contiguous(), self.ep_group)  # [ep*T, k]
        first = self.ep_rank * self.local_experts
        mine = (all_ids >= first) & (all_ids < first + self.local_experts)
        local_ids = torch.where(mine, all_ids - first, torch.full_like(all_ids, -1))
        routed = self.route_counts.gathered_own(routes=expert_ids.numel(), ep_rank=self.ep_rank,
                                                ep_size=self.ep_size, num_experts=self.num_experts)
        permuted, sorted_index, group_sizes = ops.permute_tokens(gathered, local_ids, self.local_experts, routed)
        return permuted, group_sizes, (gathered.shape[0], sorted_index)

    def combine(self, expert_output: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        num_tokens, sorted_index = state
        all_weights = mappings.gather_from_sequence_parallel_region(weights.to(expert_output.dtype), self.ep_group)
        partial = ops.unpermute_tokens(expert_output, sorted_index, all_weights, num_tokens)  # [ep*T, h], my experts
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)  # [T, h]


def use_route_counts(modules, route_counts: RouteCounts) -> None:
    """Every dispatcher in `modules` (e.g. a model's chunks) learns its route counts from `route_counts`."""
    for module in modules:
        for child in module.modules():
            dispatcher = getattr(child, "dispatcher", None)
            if isinstance(dispatcher, (AllToAllDispatcher, AllGatherDispatcher)):
                dispatcher.route_counts = route_counts


def make_dispatcher(kind: str, moe: MoEConfig, groups: LayerGroups):
    """The dispatcher `kind` (--moe-token-dispatcher-type) for a layer of config `moe` over `groups`."""
    if kind == MoEDispatcher.ALLTOALL:
        return AllToAllDispatcher(moe, groups)
    if kind == MoEDispatcher.ALLGATHER:
        return AllGatherDispatcher(moe, groups)
    raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
