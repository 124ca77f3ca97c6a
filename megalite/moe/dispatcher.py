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
"""
from __future__ import annotations

import torch

from megalite import comm, ops
from megalite.layer_groups import LayerGroups
from megalite.moe.config import MoEConfig
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


class AllToAllDispatcher:
    """moe: the layer's MoEConfig (its num_experts); groups: the LayerGroups it talks over (groups.ep)."""

    def __init__(self, moe: MoEConfig, groups: LayerGroups):
        self.num_experts, self.ep_group = moe.num_experts, groups.ep
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
        routes: the rows this rank sends (= send_counts.sum()); unused here, but the one fact a
        simulated rank (meta tensors, no counts) has to answer from (megalite/simulate/routing.py)."""
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all(recv_counts, send_counts.contiguous(), self.ep_group)
        counts = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # one host read
        return recv_counts, counts[0], counts[1]

    def combine(self, expert_output: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        num_tokens, sorted_index, exchange = state
        if exchange is not None:
            order, send_splits, recv_splits = exchange
            source_major = expert_output[torch.argsort(order)]
            expert_output = _AllToAllVariable.apply(source_major, send_splits, recv_splits, self.ep_group)
        return ops.unpermute_tokens(expert_output, sorted_index, weights.to(expert_output.dtype), num_tokens)


class AllGatherDispatcher:
    """moe: the layer's MoEConfig (its num_experts); groups: the LayerGroups it talks over (groups.ep)."""

    def __init__(self, moe: MoEConfig, groups: LayerGroups):
        self.num_experts, self.ep_group = moe.num_experts, groups.ep
        self.ep_size, self.ep_rank = comm.group_size(groups.ep), comm.group_rank(groups.ep)
        self.local_experts = moe.num_experts // self.ep_size

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        # [T, h] -> [ep*T, h]; backward: the gradients of every rank's copy summed onto its owner
        gathered = mappings.gather_from_sequence_parallel_region(tokens, self.ep_group)
        all_ids = comm.all_gather(expert_ids.contiguous(), self.ep_group)  # [ep*T, k]
        first = self.ep_rank * self.local_experts
        mine = (all_ids >= first) & (all_ids < first + self.local_experts)
        local_ids = torch.where(mine, all_ids - first, torch.full_like(all_ids, -1))
        permuted, sorted_index, group_sizes = ops.permute_tokens(gathered, local_ids, self.local_experts)
        return permuted, group_sizes, (gathered.shape[0], sorted_index)

    def combine(self, expert_output: torch.Tensor, weights: torch.Tensor, state) -> torch.Tensor:
        num_tokens, sorted_index = state
        all_weights = mappings.gather_from_sequence_parallel_region(weights.to(expert_output.dtype), self.ep_group)
        partial = ops.unpermute_tokens(expert_output, sorted_index, all_weights, num_tokens)  # [ep*T, h], my experts
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)  # [T, h]


def make_dispatcher(kind: str, moe: MoEConfig, groups: LayerGroups):
    """The dispatcher `kind` (--moe-token-dispatcher-type) for a layer of config `moe` over `groups`."""
    if kind == "alltoall":
        return AllToAllDispatcher(moe, groups)
    if kind == "allgather":
        return AllGatherDispatcher(moe, groups)
    raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
