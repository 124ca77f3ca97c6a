"""Mixture of experts in the planner: expert parameters per rank, token-dispatch bytes, routing buffers.

Pure arithmetic (no torch). Per MoE block on a rank (E experts, ep ranks, tp, etp (1 or tp), expert
width f_e, T = s*b tokens of a microbatch routed per rank: at etp = tp every tp rank routes the
whole sequence (under SP the block gathers it), at etp = 1 each tp rank its own T/tp):

- parameters: the router E*h (replicated), E/ep local experts of (h*mlp_in + f_e*h)/etp each
  (mlp_in = 2 f_e for SwiGLU), a shared expert's dense MLP /tp, instead of the dense MLP;
- expert parameters are replicated over the expert-data-parallel group (dp*cp/ep ranks, times tp
  at etp = 1): their ZeRO shards, gradient reductions and gathers run there (ledger group "edp"
  when ep > 1 or etp < tp);
- all-to-all dispatcher: per microbatch and block, forward the counts (E int64) and two
  all-to-alls of the k*T routes ([T*k, h], dispatch and combine), backward two more: 4*a*T*k*h
  + 8*E bytes on the "ep" group (comm.ledger counts an all-to-all's input, rows to itself
  included); all-gather dispatcher: tokens, routes and weights gathered, the output reduce-scattered;
- routing buffers kept for backward, per block and microbatch: the permuted and received routes
  2*a*T*k*h, the experts' inputs and outputs a*T*k*(h + mlp_in/tp + f_e/tp), the fp32 scores
  8*T*E (logits and probabilities): replacing the dense MLP's activations.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.model.config import GPTConfig
from megalite.pipeline.partition import stage_layers as partition_stage_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def stage_moe_layers(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """MoE blocks held by pipeline stage `stage` (every chunk of it)."""
    if model.moe is None:
        return 0
    p = cfg.parallel
    ranges = [range(model.num_layers)] if p.pp == 1 else partition_stage_layers(
        model.num_layers, p.pp, p.virtual_stages, stage, p.decoder_first_stage_layers, p.decoder_last_stage_layers,
        p.pipeline_layout)
    return sum(model.moe.is_moe_layer(i) for r in ranges for i in r)


def _mlp_params(model: GPTConfig, ffn: int, tp: int, bias: bool) -> int:
    mlp_in = ffn if model.flavour == "gpt2" else 2 * ffn
    return (model.hidden_size * mlp_in + ffn * model.hidden_size) // tp + ((mlp_in // tp + model.hidden_size)
                                                                          if bias else 0)


def expert_params_per_layer(model: GPTConfig, cfg: RunConfig) -> int:
    """One MoE block's expert parameters on one rank: E/ep experts, each /etp."""
    moe = model.moe
    return moe.num_experts // cfg.parallel.ep * _mlp_params(model, moe.expert_ffn(model.ffn_hidden_size),
                                                           expert_tp(cfg), False)


def expert_tp(cfg: RunConfig) -> int:
    """The tp degree inside an expert: --etp when it is 1 or --tp (anything else is refused by validate())."""
    etp, tp = getattr(cfg.parallel, "etp", cfg.parallel.tp), cfg.parallel.tp
    return etp if etp in (1, tp) else tp


def experts_apart(model: GPTConfig, cfg: RunConfig) -> bool:
    """Whether the experts have a replica group of their own (ep > 1, or whole experts over tp > 1)."""
    return model.moe is not None and (cfg.parallel.ep > 1 or expert_tp(cfg) < cfg.parallel.tp)


def routed_tokens(model: GPTConfig, cfg: RunConfig) -> int:
    """Tokens of a microbatch one rank routes: s/cp * b, split over tp at etp = 1."""
    tokens = model.seq_length // cfg.parallel.cp * cfg.training.micro_batch_size
    return tokens // (cfg.parallel.tp // expert_tp(cfg))


def dense_change_per_layer(model: GPTConfig, cfg: RunConfig) -> int:
    """An MoE block's non-expert parameters minus the dense MLP's it replaces (one rank)."""
    moe, tp = model.moe, cfg.parallel.tp
    shared = _mlp_params(model, moe.shared_expert_intermediate_size, tp, False) \
        if moe.shared_expert_intermediate_size else 0
    return moe.num_experts * model.hidden_size + shared - _mlp_params(model, model.ffn_hidden_size, tp, model.add_bias)


def stage_expert_params(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Expert parameters of one rank of stage `stage` (sharded over ep, replicated over expert-dp)."""
    layers = stage_moe_layers(model, cfg, stage)
    return layers * expert_params_per_layer(model, cfg) if layers else 0


def expert_dp_config(cfg: RunConfig) -> RunConfig:
    """The layout the experts' replicas see: dp*cp/ep replicas (x tp at etp = 1), no cp (for
    model_state_bytes, add_dp_bytes)."""
    return cfg.replace(dp=cfg.dp * cfg.parallel.cp // cfg.parallel.ep * (cfg.parallel.tp // expert_tp(cfg)), cp=1)


def dispatch_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> dict[str, int]:
    """'ep/op' -> bytes per step on one rank of stage `stage` (dropless: every route travels)."""
    layers, ep = stage_moe_layers(model, cfg, stage), cfg.parallel.ep
    if not layers or ep == 1:
        return {}
    from megalite.plan.layout import DTYPE_BYTES

    a, m, k, h = DTYPE_BYTES[cfg.precision.precision], cfg.num_microbatches, model.moe.topk, model.hidden_size
    tokens = routed_tokens(model, cfg)
    forwards = m * layers * (2 if cfg.parallel.recompute == "full" else 1)  # full recompute dispatches again
    if cfg.parallel.moe_token_dispatcher_type == "allgather":
        gathered = ep * tokens
        return {"ep/all_gather": forwards * gathered * (h * a + k * 8 + k * a) + m * layers * gathered * h * a,
                "ep/reduce_scatter": forwards * gathered * h * a + m * layers * gathered * (h + k) * a}
    routes = tokens * k
    return {"ep/all_to_all": forwards * (2 * routes * h * a + 8 * model.moe.num_experts)
            + m * layers * 2 * routes * h * a}


def routing_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Bytes an MoE block keeps for backward beyond the attention part, per microbatch (one rank)."""
    from megalite.plan.layout import DTYPE_BYTES

    moe, a, t, et = model.moe, DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp, expert_tp(cfg)
    tokens = model.seq_length // cfg.parallel.cp * cfg.training.micro_batch_size
    mine = routed_tokens(model, cfg)  # routed on this rank (T/tp at etp = 1)
    routes, f = mine * moe.topk, moe.expert_ffn(model.ffn_hidden_size)
    mlp_in = f if model.flavour == "gpt2" else 2 * f
    total = 2 * a * routes * model.hidden_size + a * routes * (model.hidden_size + mlp_in // et + f // et)
    total += 8 * mine * moe.num_experts
    if moe.shared_expert_intermediate_size:
        s_f = moe.shared_expert_intermediate_size
        total += a * tokens * (model.hidden_size + (2 if model.flavour == "gpt2" else 3) * s_f // t)
    return total
