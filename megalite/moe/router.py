"""The router: scores, top-k choice, capacity drops, and the balancing losses.

    routing = router(tokens)              # tokens [T, h] -> Routing (expert_ids, weights [T, k], losses)

Scores are computed in fp32 from `logits = tokens @ W^T` ([T, E]):
- softmax (default): the k largest logits are chosen and their weights are a softmax over those k
  (Mixtral's renormalised top-k); with `pre_softmax` the softmax runs over all E experts first and
  the chosen probabilities are the weights as they are.
- sigmoid (DeepSeek-V3): sigmoid(logits); the chosen scores, divided by their sum when k > 1.

Group-limited routing (DeepSeek-V2/V3, `num_groups` and `group_topk`): the E experts are G groups of
E/G consecutive ids; a group's score is its best selection score (softmax, V2) or the sum of its two
best (sigmoid, V3); each token keeps its `group_topk` best groups and picks its k experts among
theirs. `topk_scaling_factor` (DeepSeek's routed_scaling_factor) multiplies the final weights.

Ties choose the lower expert index (a stable sort), so routing is deterministic whatever the
layout. With `enable_expert_bias` a per-expert bias (a buffer, not trained by gradients) is added
to the scores for the choice only; `update_expert_bias` moves it each step toward the mean load.

Losses (each returned unweighted and added by the layer with its coefficient):
- aux_loss (Switch Transformer / GShard): E / (T^2 k) * sum_e (sum_t p_te) * c_e, where p are the
  scores (softmax over all experts; sigmoid scores normalised per token) and c_e the routes to e;
- seq_aux_loss: the same per sequence (tokens of one sequence), averaged over sequences;
- z-loss (ST-MoE): mean_t logsumexp(logits_t)^2.

Under context parallelism (`token_group`: the cp group) a rank holds s/cp tokens of each
sequence (with whole experts under tp, etp = 1, the tp x cp group: s/(cp*tp) tokens); the losses
stay those of the whole sequences: the route counts are summed over the
group (no gradient flows through counts) and each rank returns its tokens' share of the loss
(T and s are the whole sequences'), so the shares sum over the cp ranks to the cp = 1 value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config.choices import MoEDropPolicy, MoELoadBalancing, MoEScoreFunction
from megalite.distributed import comm, uneven
from megalite.config.moe import MoEConfig
from megalite.plan.moe import balanced_routes


@dataclass
class Routing:
    expert_ids: torch.Tensor
    """[T, k] int64, the chosen experts (-1: a route dropped over capacity)."""
    weights: torch.Tensor
    """[T, k] fp32 combine weights (differentiable into the router)."""
    tokens_per_expert: torch.Tensor
    """[E] int64 routes chosen per expert, before any drop."""
    dropped: torch.Tensor
    """[] int64 routes dropped over capacity."""
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None


def top_k_deterministic(selection: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] -> [T, k] indices of the k largest per row; ties go to the lower index."""
    return torch.sort(selection, dim=-1, descending=True, stable=True).indices[:, :k]


def group_limited_selection(selection: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[T, E] selection scores -> the same with the experts outside each token's `group_topk` best groups
    set to -inf (ties between groups go to the lower group)."""
    tokens, experts = selection.shape
    grouped = selection.view(tokens, moe.num_groups, experts // moe.num_groups)  # [T, G, E/G]
    best = torch.sort(grouped, dim=-1, descending=True).values[..., :moe.group_score_experts()]
    chosen = top_k_deterministic(best.sum(-1), moe.group_topk)  # [T, group_topk]
    keep = torch.zeros(tokens, moe.num_groups, dtype=torch.bool, device=selection.device)
    keep.scatter_(1, chosen, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def balanced_expert_ids(num_tokens: int, k: int, num_experts: int, ep: int, ep_rank: int, device) -> torch.Tensor:
    """--moe-router-force-load-balancing: [T, k] expert ids whose counts are the planner's balanced
    routing (`plan.moe.balanced_routes` of the T*k routes of ep rank `ep_rank`, to every ep rank's
    experts). The ids sorted by expert fill the slots column by column (slot j of token t: the
    (j*T + t)-th), so a token's k experts differ: no expert gets more than T routes, as k <= E."""
    counts = [n for dest in range(ep) for n in balanced_routes(num_tokens * k, num_experts, ep, ep_rank, dest)]
    ids = torch.repeat_interleave(torch.arange(num_experts, device=device),
                                  torch.tensor(counts, device=device), output_size=num_tokens * k)
    return ids.view(k, num_tokens).t()


def load_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                        token_group=None, group_tokens: int | None = None) -> torch.Tensor:
    """E / (T^2 k) * sum_e (sum_t scores[t, e]) * routes_e; scores [T, E], expert_ids [T, k].

    1.0 when the load and the probability mass are both uniform. With a `token_group` the tokens
    are split over its ranks: this rank's share (see the module docstring); group_tokens: T, the
    tokens of the whole group, where the ranks' shares differ (None: this rank's times the ranks)."""
    tokens, k = expert_ids.shape
    routes = torch.bincount(expert_ids.reshape(-1), minlength=num_experts).to(scores.dtype)  # [E]
    tokens = _summed(routes, token_group, tokens, group_tokens)
    return (scores.sum(0) * routes).sum() * (num_experts / (tokens * tokens * k))


def _summed(counts: torch.Tensor, token_group, mine: int, group_total: int | None) -> int:
    """Sum `counts` over the ranks sharing the sequences (in place); returns the group's total of a count
    of which this rank holds `mine` (group_total where the ranks' shares differ; else mine per rank)."""
    comm.all_reduce(counts, token_group)
    return group_total if group_total is not None else mine * comm.group_size(token_group)


def sequence_load_balancing_loss(scores: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                                 num_sequences: int, token_group=None, group_tokens: int | None = None) -> torch.Tensor:
    """The load-balancing loss of each sequence, averaged. Tokens are [s, b] flattened (t = i*b + j):
    sequence j is every b-th token from j. group_tokens: as load_balancing_loss's."""
    tokens, k = expert_ids.shape
    s = tokens // num_sequences
    per_sequence_scores = scores.view(s, num_sequences, num_experts).sum(0)  # [b, E]
    one_hot = F.one_hot(expert_ids.view(s, num_sequences, k), num_experts).sum((0, 2)).to(scores.dtype)  # [b, E]
    s = _summed(one_hot, token_group, s, None if group_tokens is None else group_tokens // num_sequences)
    return (per_sequence_scores * one_hot).sum() * (num_experts / (s * s * k)) / num_sequences


def capacity_keep_mask(expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int,
                       policy: str) -> torch.Tensor:
    """[T, k] bool: the routes each expert keeps when it takes at most `capacity` of them.

    policy "probs": an expert keeps its highest-weight routes; "position": its earliest tokens.
    Ties keep the earlier (token, slot), so the choice is deterministic."""
    flat_ids = expert_ids.reshape(-1)  # route r = t*k + slot
    order = torch.arange(flat_ids.numel(), device=flat_ids.device)
    if policy == MoEDropPolicy.PROBS:  # highest weight first, token order among equals
        order = torch.sort(weights.detach().reshape(-1), descending=True, stable=True).indices
    order = order[torch.sort(flat_ids[order], stable=True).indices]  # grouped by expert, policy order inside
    counts = torch.bincount(flat_ids, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_ids[order]]
    keep = torch.empty_like(flat_ids, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(expert_ids)


class Router(nn.Module):
    """tokens [T, h] -> Routing. Weight [E, h], replicated over tp (etp = tp: every tp rank routes alike;
    etp = 1: each its own tokens, the gradient summed over tp)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, init_std: float, dtype=None, device=None,
                 ep_place: tuple[int, int] = (0, 1)):
        super().__init__()
        self.moe = moe
        self.ep_rank, self.ep_size = ep_place  # force_load_balancing: the routes this ep rank sends
        full = torch.empty(moe.num_experts, hidden_size)
        nn.init.normal_(full, mean=0.0, std=init_std)
        self.weight = nn.Parameter(full.to(device=device, dtype=dtype))
        if moe.enable_expert_bias:  # fp32 buffers: the bias and this step's routes per expert
            on = device if device is not None and torch.device(device).type != "meta" else None
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, device=on))
            self.register_buffer("step_tokens_per_expert", torch.zeros(moe.num_experts, device=on))
        else:
            self.expert_bias = None

    def forward(self, tokens: torch.Tensor, num_sequences: int, token_group=None, capacity_group=None,
                token_order: torch.Tensor | None = None, *, token_counts: list[int] | None = None) -> Routing:
        """tokens [T, h]; num_sequences b (tokens are [s, b] flattened); token_group: the ranks holding the
        other tokens of these sequences (cp; tp x cp when each tp rank routes its own, etp = 1);
        capacity_group: the ranks whose tokens (this rank's slice of dim 0 in rank order) together make
        the set an expert's capacity is counted over (None: this rank's tokens); token_order [T] int64:
        each token's index in the single process's [s, b] flattening, where the group's rank order is
        not that order (cp's zigzag chunks; None: it is); token_counts: the tokens each rank of token_group
        holds (group rank order) where they differ (an uneven split at etp 1; capacity_group is then the
        token group); None: T on every rank."""
        moe, k = self.moe, self.moe.topk
        group_tokens = None if token_counts is None else sum(token_counts)  # the whole group's T
        logits = F.linear(tokens.float(), self.weight.float())  # [T, E] fp32
        if moe.score_function == MoEScoreFunction.SIGMOID:
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        selection = scores if self.expert_bias is None else scores.detach() + self.expert_bias
        if self.expert_bias is None and moe.score_function == MoEScoreFunction.SOFTMAX:
            selection = logits.detach()  # the same order as the probabilities, and exact ties stay ties
        if moe.num_groups is not None:  # DeepSeek's group-limited routing: the groups first
            selection = group_limited_selection(selection.detach(), moe)
        expert_ids = top_k_deterministic(selection.detach(), k)  # [T, k]
        if moe.force_load_balancing:  # benchmarking / testing: the planner's balanced routes, whatever the scores
            expert_ids = balanced_expert_ids(tokens.shape[0], k, moe.num_experts, self.ep_size, self.ep_rank,
                                             tokens.device)
        if moe.score_function == MoEScoreFunction.SIGMOID:
            weights = scores.gather(1, expert_ids)
            weights = weights / weights.sum(-1, keepdim=True) if k > 1 else weights
            balance_scores = scores / scores.sum(-1, keepdim=True)
        elif moe.pre_softmax:
            weights, balance_scores = scores.gather(1, expert_ids), scores
        else:
            weights, balance_scores = torch.softmax(logits.gather(1, expert_ids), dim=-1), scores
        if moe.topk_scaling_factor is not None:
            weights = weights * moe.topk_scaling_factor
        tokens_per_expert = torch.bincount(expert_ids.reshape(-1), minlength=moe.num_experts)
        if self.expert_bias is not None and self.training and torch._C._current_graph_task_id() == -1:  # not recompute
            self.step_tokens_per_expert += tokens_per_expert.to(self.step_tokens_per_expert.dtype)
        aux = None
        if moe.load_balancing_type == MoELoadBalancing.AUX_LOSS:
            aux = load_balancing_loss(balance_scores, expert_ids, moe.num_experts, token_group, group_tokens)
        elif moe.load_balancing_type == MoELoadBalancing.SEQ_AUX_LOSS:
            aux = sequence_load_balancing_loss(balance_scores, expert_ids, moe.num_experts, num_sequences,
                                               token_group, group_tokens)
        z_loss = None
        if moe.z_loss_coeff > 0:  # this rank's share of the mean over the whole sequences
            z_loss = torch.logsumexp(logits, dim=-1).square().sum() / (
                group_tokens or tokens.shape[0] * comm.group_size(token_group))
        dropped = torch.zeros((), dtype=torch.int64, device=tokens.device)
        if moe.capacity_factor is not None:
            keep = _capacity_keep(expert_ids, weights, moe, capacity_group, token_order, token_counts)
            dropped = (~keep).sum()
            expert_ids = torch.where(keep, expert_ids, torch.full_like(expert_ids, -1))
        return Routing(expert_ids, weights, tokens_per_expert, dropped, aux, z_loss)


def _capacity_keep(expert_ids: torch.Tensor, weights: torch.Tensor, moe: MoEConfig, capacity_group,
                   token_order: torch.Tensor | None = None, token_counts: list[int] | None = None) -> torch.Tensor:
    """[T, k] bool: the routes kept, capacity counted over the tokens of `capacity_group` together (this
    rank's slice of the gathered choices: every rank decides alike, as one rank routing them all would,
    in that rank's token order: `token_order`, gathered too, when rank order is not it). token_counts:
    each rank's T where they differ (the gathers and the slice uneven)."""
    n = comm.group_size(capacity_group)
    if n > 1:  # [T, k] -> [n*T, k] (or [sum(token_counts), k]): small (k ids and weights per token), no gradient
        gather = comm.all_gather if token_counts is None else (
            lambda t, group: uneven.all_gather(t, group, token_counts))
        expert_ids = gather(expert_ids.contiguous(), capacity_group)
        weights = gather(weights.detach().contiguous(), capacity_group)
        token_order = None if token_order is None else gather(token_order.contiguous(), capacity_group)
    capacity = math.ceil(moe.capacity_factor * expert_ids.shape[0] * moe.topk / moe.num_experts)
    if token_order is None:
        keep = capacity_keep_mask(expert_ids, weights, moe.num_experts, capacity, moe.token_drop_policy)
    else:  # decided in the single process's order (the "position" policy and ties depend on it), put back
        order = torch.argsort(token_order)
        keep = torch.empty_like(expert_ids, dtype=torch.bool)
        keep[order] = capacity_keep_mask(expert_ids[order], weights[order], moe.num_experts, capacity,
                                         moe.token_drop_policy)
    if n == 1:
        return keep
    mine = comm.group_rank(capacity_group)
    return keep.chunk(n)[mine] if token_counts is None else keep.split(token_counts)[mine]


@torch.no_grad()
def update_expert_bias(router: Router, replica_group, rate: float) -> None:
    """DeepSeek-V3's step: bias_e += rate * sign(mean load - load_e), the load summed over the step's
    tokens of every replica (`replica_group`: dp x cp, where the tokens differ). Resets the count."""
    load = router.step_tokens_per_expert
    comm.all_reduce(load, replica_group)
    router.expert_bias += rate * torch.sign(load.mean() - load)
    load.zero_()
