"""MoELayer: a transformer block's MLP as a mixture of experts (router -> dispatch -> experts -> combine).

    y = moe(x)          # x [s, b, h] ([s/tp, b, h] under sequence parallelism) -> same shape

Two layouts of the experts over tp (the mesh's etp; `LayerGroups.experts_whole` when etp = 1 < tp):

etp = tp (experts_whole False): experts split over tp like the dense MLP.
1. Under SP the sequence is gathered over tp first: every tp rank routes all s*b tokens alike.
2. The router picks k experts per token ([T, h] -> expert_ids, weights [T, k]).
3. The dispatcher moves each route's token to the ep rank holding its expert ([R_local, h]).
4. The local experts run (grouped GEMMs, tensor-parallel inside: column then row), their outputs
   are summed over tp, sent back and combined with the routing weights ([T, h]).

etp = 1 (experts_whole, tp > 1): whole experts on every tp rank, and each tp rank routes only
its own 1/tp of the tokens: under SP its [s/tp, b, h] shard as it is; without SP its slice of the
replicated sequence (split on entry, the output all-gathered on exit; any length s: where tp does not
divide it the first s % tp ranks take one row more, megalite/distributed/uneven.py). No tp collective touches
the experts' activations; the tp ranks' replicas of an expert saw different tokens, so their
gradients reduce over expert-dp x tp (the mesh's expert_dp_group) and the router's over tp. The
router's per-microbatch statistics are over the token group (groups.moe_tokens: tp x cp).

Capacity drops (a capacity factor) are decided over a microbatch's tokens together, in the single
process's token order, at every layout: the ranks routing parts of it (cp; tp x cp at etp 1) gather
their [T, k] choices (and, under cp, each token's index in the [s, b] flattening: cp's zigzag chunks
are not in sequence order) and each keeps its slice of the one decision.

5. A shared expert (a dense tp MLP over the whole sequence, either layout) is added when configured.

The balancing losses do not travel with the activations: `_AttachLosses` adds their gradient in
backward (Megatron's MoEAuxLossAutoScaler), scaled by `loss_scale`, which the train step sets to
(fp16 loss scale) / (forwards whose losses the step averages: microbatches x dp; the ranks of
`token_group` each hold a share of a forward's losses, router.py). Any stage of
a pipeline can therefore hold MoE layers. Each forward also accumulates this layer's statistics
for the step's metrics (`moe_stats`): the losses, routes per expert and dropped routes.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.distributed import comm
from megalite.distributed.uneven import split_sizes
from megalite.parameters import params
from megalite.config.moe import MoEConfig
from megalite.moe.dispatcher import make_dispatcher
from megalite.moe.experts import LocalExperts
from megalite.context_parallel.zigzag import position_ids
from megalite.distributed.layer_groups import LayerGroups
from megalite.layout import LayoutError, expert_count_problem
from megalite.moe.router import Router
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.mlp import MLP


def recomputing() -> bool:
    """True inside a backward pass: a forward running there is activation recompute's second one."""
    return torch._C._current_graph_task_id() != -1


class _AttachLosses(torch.autograd.Function):
    """Forward: `output` unchanged. Backward: also d(loss)/d(loss) = scale, into the router."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoELayer(nn.Module):
    """config: the model's GPTConfig (its .moe); groups: the LayerGroups it talks over: experts sharded over
    groups.ep, split over groups.tp unless groups.experts_whole (etp = 1, see the module docstring), the
    tokens of a microbatch routed together over groups.moe_tokens at etp = 1 (tp x cp), else over groups.cp.
    sequence_parallel: x is the [s/tp, b, h] shard; moe_dispatcher: --moe-token-dispatcher-type;
    layer_number: the block's global index."""

    def __init__(self, config, groups: LayerGroups, *, sequence_parallel: bool, moe_dispatcher: str = "alltoall",
                 layer_number: int = 0, dtype=None, device=None):
        super().__init__()
        tp_group, ep_group, cp_group = groups.tp, groups.ep, groups.cp
        self.layer_number = layer_number
        moe: MoEConfig = config.moe
        ep = comm.group_size(ep_group)
        problem = expert_count_problem(moe.num_experts, ep)  # the layout's rule, for an ep group of another mesh
        if problem:
            raise LayoutError(problem)
        self.moe, self.tp_group, self.sequence_parallel = moe, tp_group, sequence_parallel
        # etp = 1 under tp > 1: whole experts, each tp rank routing its own 1/tp of the tokens (over a tp group
        # of one rank whole experts are the split layout)
        self.experts_whole = groups.experts_whole and comm.group_size(tp_group) > 1
        if self.experts_whole and groups.moe_tokens is None:
            raise ValueError("whole experts under tp (experts_whole) route each tp rank's own tokens: pass "
                             "moe_tokens, the ranks sharing a microbatch's tokens (the mesh's moe_token_group)")
        # the ranks holding the other tokens of this microbatch's sequences (the losses are theirs together)
        self.token_group = groups.moe_tokens if self.experts_whole else cp_group
        self.cp_group = cp_group  # cp splits each sequence into zigzag chunks (the capacity's token order)
        self.router = Router(config.hidden_size, moe, config.init_std, dtype, device,
                             ep_place=(comm.group_rank(ep_group), ep))
        if self.experts_whole:  # each tp rank's router gradient comes from its own tokens: summed over tp
            params.declare(self.router.weight, sequence_parallel_grad=True)
        base_seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu").item())  # this block's stream: the same on every rank
        local = moe.num_experts // ep
        first = comm.group_rank(ep_group) * local
        self.experts = LocalExperts(config.hidden_size, moe.expert_ffn(config.ffn_hidden_size),
                                    gated=config.flavour == "llama", expert_ids=range(first, first + local),
                                    base_seed=base_seed, init_std=config.init_std, num_layers=config.num_layers,
                                    tp_group=None if self.experts_whole else tp_group, dtype=dtype, device=device)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            shared = config.replace(ffn_hidden_size=moe.shared_expert_intermediate_size, moe=None, add_bias=False,
                                    mlp_bias=False)
            # runs on the gathered sequence
            self.shared_expert = MLP(shared, tp_group, sequence_parallel=False, dtype=dtype, device=device)
        self.shared_expert_gate = None
        if moe.shared_expert_gate:  # [1, h]: a per-token sigmoid weight of the shared expert's output
            gate = torch.empty(1, config.hidden_size)
            nn.init.normal_(gate, std=config.init_std)
            self.shared_expert_gate = nn.Parameter(gate.to(device=device, dtype=dtype or gate.dtype))
        self.dispatcher = make_dispatcher(moe_dispatcher, moe, groups)
        self.loss_scale = 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"forwards": 0, "aux_loss": 0.0, "z_loss": 0.0, "dropped": 0, "routes": 0,
                      "tokens_per_expert": None}

    def forward(self, x: torch.Tensor, split_order: torch.Tensor | None = None) -> torch.Tensor:
        """x [s', b, h] -> the same shape. split_order [b, s * cp]: under the per-document cp split
        (context_parallel/document_split.py) which global positions each cp rank holds, read by a capacity
        factor's token order; None: the zigzag split (or cp 1)."""
        if self.experts_whole:
            return self._forward_own_tokens(x, split_order)
        full = mappings.gather_from_sequence_parallel_region(x, self.tp_group, grad_is_partial=False) \
            if self.sequence_parallel else x  # [s, b, h]: every tp rank sees (and routes) the same tokens
        out, routing = self._experts(full, self.tp_group, self.cp_group, split_order=split_order)  # [s/cp, b, h]
        if self.shared_expert is not None:
            out = out + self._shared(full)
        out = self._attach_losses(out, routing)
        if self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/tp, b, h]
        return out.to(x.dtype)

    def _shared(self, full: torch.Tensor) -> torch.Tensor:
        """The shared expert on the whole (replicated) sequence [s, b, h], gated per token when configured."""
        out = self.shared_expert(full)
        if self.shared_expert_gate is None:
            return out
        return out * torch.sigmoid(torch.nn.functional.linear(full, self.shared_expert_gate))  # [s, b, 1]

    def _forward_own_tokens(self, x: torch.Tensor, split_order: torch.Tensor | None) -> torch.Tensor:
        """etp = 1: this tp rank routes and runs its own tokens through whole experts: under SP its [s/tp, b, h]
        shard as it is; else its rows of the replicated [s, b, h], split_sizes(s, tp) of them (an uneven split
        where tp does not divide s: 21 tokens over tp 2 are 11 and 10 rows)."""
        tp = self.tp_group
        rows = None if self.sequence_parallel else split_sizes(x.shape[0], comm.group_size(tp))
        mine = x if self.sequence_parallel else mappings.scatter_to_sequence_parallel_region(x, tp, sizes=rows)
        tp_rows = rows or [mine.shape[0]] * comm.group_size(tp)  # every tp rank's rows of this cp rank's sequence
        out, routing = self._experts(mine, None, self.token_group, tp_rows=tp_rows,
                                     split_order=split_order)  # [rows, b, h]
        if self.shared_expert is not None:  # a dense tp MLP on the whole sequence, then my rows of its output
            full = mappings.gather_from_sequence_parallel_region(x, tp, grad_is_partial=False) \
                if self.sequence_parallel else x
            out = out + mappings.scatter_to_sequence_parallel_region(self._shared(full), tp, sizes=rows)
        out = self._attach_losses(out, routing)
        if not self.sequence_parallel:  # the block's output is replicated over tp: every rank's rows, gathered
            out = mappings.gather_from_sequence_parallel_region(out, tp, grad_is_partial=False, sizes=rows)
        return out.to(x.dtype)  # [s, b, h] (SP: [s/tp, b, h])

    def _experts(self, x: torch.Tensor, etp_group, capacity_group, *, tp_rows: list[int] | None = None,
                 split_order: torch.Tensor | None = None):
        """Route x [s', b, h], run the routes through the experts, combine: ([s', b, h], its Routing).

        etp_group: the group the experts are split over (None: whole experts); capacity_group: the
        ranks whose tokens, taken together, an expert's capacity is counted over (None: this rank's);
        tp_rows: at etp 1, the rows of this cp rank's sequence each tp rank routes (they may differ by one)."""
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        token_counts = None  # the tokens of each rank of token_group (tp fastest, then cp), where they differ
        if tp_rows is not None and len(set(tp_rows)) > 1:
            token_counts = [rows * b for _ in range(comm.group_size(self.cp_group)) for rows in tp_rows]
        order = self._token_order(s, b, x.device, tp_rows=tp_rows, split_order=split_order) \
            if self.moe.capacity_factor is not None else None
        routing = self.router(tokens, b, self.token_group, capacity_group, order, token_counts=token_counts)
        expert_tokens = mappings.copy_to_tensor_parallel_region(tokens, etp_group)  # experts: tp inside
        expert_input, group_sizes, state = self.dispatcher.dispatch(expert_tokens, routing.expert_ids)
        expert_output = self.experts(expert_input, group_sizes)  # [R_local, h], partial over etp_group
        expert_output = mappings.reduce_from_tensor_parallel_region(expert_output, etp_group)
        return self.dispatcher.combine(expert_output, routing.weights, state).view(s, b, h), routing

    def _token_order(self, rows: int, b: int, device, *, tp_rows: list[int] | None,
                     split_order: torch.Tensor | None) -> torch.Tensor | None:
        """[rows*b] int64: the index of each of this rank's tokens (x's rows [rows, b] flattened) in the
        single process's [s, b] flattening, pos*b + j; None at cp = 1, where the ranks' order is that.
        tp_rows: at etp 1, each tp rank's rows of this cp rank's tokens (mine a contiguous slice of them);
        split_order [b, s]: the per-document split's (each sample's own positions), None: zigzag's."""
        cp, cp_rank = comm.group_size(self.cp_group), comm.group_rank(self.cp_group)
        if cp == 1:
            return None
        cp_rows = sum(tp_rows) if tp_rows is not None else rows  # this cp rank's rows of the sequence
        if split_order is None:  # [s/cp, 1]: the zigzag chunks, the same in every sample
            positions = position_ids(cp_rows * cp, cp_rank, cp, device=device).view(cp_rows, 1)
        else:  # [s/cp, b]: sample j's tokens on this rank
            positions = split_order[:, cp_rank * cp_rows:(cp_rank + 1) * cp_rows].t().to(device)
        if tp_rows is not None:  # my tp rank's contiguous slice of this cp rank's tokens
            first = sum(tp_rows[:comm.group_rank(self.tp_group)])
            positions = positions[first:first + rows]
        return (positions * b + torch.arange(b, device=device).view(1, b)).reshape(-1)

    def _attach_losses(self, out: torch.Tensor, routing) -> torch.Tensor:
        moe, terms = self.moe, []
        if routing.aux_loss is not None and moe.aux_loss_coeff > 0:
            terms.append(moe.aux_loss_coeff * routing.aux_loss)
        if routing.z_loss is not None:
            terms.append(moe.z_loss_coeff * routing.z_loss)
        if self.training and not recomputing():  # a recomputed forward (activation recompute) counts nothing
            self._record(routing)
        if terms and torch.is_grad_enabled() and self.training:
            out = _AttachLosses.apply(out, sum(terms), float(self.loss_scale))
        return out

    @torch.no_grad()
    def _record(self, routing) -> None:
        """Add this forward's statistics (device tensors: nothing is read on the host here)."""
        st = self.stats
        st["forwards"] += 1 / comm.group_size(self.token_group)  # a rank holds a share of the forward's losses
        st["aux_loss"] = st["aux_loss"] + (routing.aux_loss.detach() if routing.aux_loss is not None else 0.0)
        st["z_loss"] = st["z_loss"] + (routing.z_loss.detach() if routing.z_loss is not None else 0.0)
        st["dropped"] = st["dropped"] + routing.dropped
        st["routes"] += routing.expert_ids.numel()
        tpe = routing.tokens_per_expert
        st["tokens_per_expert"] = tpe if st["tokens_per_expert"] is None else st["tokens_per_expert"] + tpe
