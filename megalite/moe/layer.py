"""MoELayer: a transformer block's MLP as a mixture of experts (router -> dispatch -> experts -> combine).

    y = moe(x)          # x [s, b, h] ([s/tp, b, h] under sequence parallelism) -> same shape

1. Under SP the sequence is gathered over tp first: every tp rank routes all s*b tokens alike.
2. The router picks k experts per token ([T, h] -> expert_ids, weights [T, k]).
3. The dispatcher moves each route's token to the ep rank holding its expert ([R_local, h]).
4. The local experts run (grouped GEMMs, tensor-parallel inside: column then row), their outputs
   are summed over tp, sent back and combined with the routing weights ([T, h]).
5. A shared expert (a dense MLP over every token) is added when configured.

The balancing losses do not travel with the activations: `_AttachLosses` adds their gradient in
backward (Megatron's MoEAuxLossAutoScaler), scaled by `loss_scale`, which the train step sets to
(fp16 loss scale) / (forwards whose losses the step averages: microbatches x dp; the cp ranks of a
forward each hold a share of its losses, router.py). Any stage of
a pipeline can therefore hold MoE layers. Each forward also accumulates this layer's statistics
for the step's metrics (`moe_stats`): the losses, routes per expert and dropped routes.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite import comm
from megalite.moe.config import MoEConfig
from megalite.moe.dispatcher import make_dispatcher
from megalite.moe.experts import LocalExperts
from megalite.moe.router import Router
from megalite.tensor_parallel import mappings


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
    def __init__(self, config, tp_group, ep_group, sequence_parallel: bool, dispatcher_type: str = "alltoall",
                 dtype=None, device=None, cp_group=None):
        super().__init__()
        from megalite.model.transformer import MLP  # the shared expert is a dense MLP

        moe: MoEConfig = config.moe
        ep = comm.group_size(ep_group)
        if moe.num_experts % ep:
            raise ValueError(f"--num-experts {moe.num_experts} is not divisible by ep={ep}; choose --ep dividing it")
        self.moe, self.tp_group, self.sequence_parallel = moe, tp_group, sequence_parallel
        self.cp_group = cp_group  # the ranks holding the other tokens of these sequences (losses are theirs)
        self.router = Router(config.hidden_size, moe, config.init_std, dtype, device)
        base_seed = int(torch.randint(0, 2 ** 62, (1,), device="cpu").item())  # this block's stream: the same on every rank
        local = moe.num_experts // ep
        first = comm.group_rank(ep_group) * local
        self.experts = LocalExperts(config.hidden_size, moe.expert_ffn(config.ffn_hidden_size),
                                    config.flavour == "llama", range(first, first + local), base_seed,
                                    config.init_std, config.num_layers, tp_group, dtype, device)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            shared = config.replace(ffn_hidden_size=moe.shared_expert_intermediate_size, moe=None, add_bias=False)
            self.shared_expert = MLP(shared, tp_group, False, dtype, device)  # runs on the gathered sequence
        self.dispatcher = make_dispatcher(dispatcher_type, moe.num_experts, ep_group)
        self.loss_scale = 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"forwards": 0, "aux_loss": 0.0, "z_loss": 0.0, "dropped": 0, "routes": 0,
                      "tokens_per_expert": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = mappings.gather_from_sequence_parallel_region(x, self.tp_group, grad_is_partial=False) \
            if self.sequence_parallel else x  # [s, b, h]: every tp rank sees (and routes) the same tokens
        s, b, h = full.shape
        tokens = full.reshape(s * b, h)
        routing = self.router(tokens, b, self.cp_group)
        expert_tokens = mappings.copy_to_tensor_parallel_region(tokens, self.tp_group)  # experts: tp inside
        expert_input, group_sizes, state = self.dispatcher.dispatch(expert_tokens, routing.expert_ids)
        expert_output = self.experts(expert_input, group_sizes)  # [R_local, h], partial over tp
        expert_output = mappings.reduce_from_tensor_parallel_region(expert_output, self.tp_group)
        out = self.dispatcher.combine(expert_output, routing.weights, state).view(s, b, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(full)
        out = self._attach_losses(out, routing)
        if self.sequence_parallel:
            out = mappings.scatter_to_sequence_parallel_region(out, self.tp_group)  # [s/tp, b, h]
        return out.to(x.dtype)

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
        st["forwards"] += 1 / comm.group_size(self.cp_group)  # a cp rank holds a share of the forward's losses
        st["aux_loss"] = st["aux_loss"] + (routing.aux_loss.detach() if routing.aux_loss is not None else 0.0)
        st["z_loss"] = st["z_loss"] + (routing.z_loss.detach() if routing.z_loss is not None else 0.0)
        st["dropped"] = st["dropped"] + routing.dropped
        st["routes"] += routing.expert_ids.numel()
        tpe = routing.tokens_per_expert
        st["tokens_per_expert"] = tpe if st["tokens_per_expert"] is None else st["tokens_per_expert"] + tpe
