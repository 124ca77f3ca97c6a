"""FP8's amax all-reduces in the planner: how many a step issues, over which group, and their bytes.

A tensorwise scale is the amax of the whole logical tensor, so a cast of a shard MAX-reduces its
amax over the ranks holding the other shards (megalite/fp8/linear.py, grouped.py); rowwise
reduces where a GEMM's contraction dim is split. Per FP8 linear, with T = s/cp * b tokens, N and
K its local out and in features, per forward pass (F: 1, 2 for a block full recompute re-runs)
and per backward (B = 1), each reduction one all-reduce (fp32 scales; ledger group: tp, cp):

    tensorwise   forward   x over tp unless replicated (column-parallel without SP), x over cp,
                           W over tp                                       4 bytes each
                 backward  g over tp (column), g over cp, W again (the dgrad cast) over tp
    rowwise      forward   row-parallel: x [T] and W [N] over tp
                 backward  column-parallel: g [T] and W [K] over tp
                 wgrad     g [N] and x [K] per feature over the tokens: over cp

With --fp8-param-gather (ZeRO-3, tensorwise) the blocks' linears cast no weight: each gather of
a unit holding FP8 weights all-reduces those weights' amaxes ([w] fp32) over the gather group
(dp, or dp_cp), then over tp (megalite/fp8/param_gather.py).

The MoE experts (E = E/ep local experts, R = T_routed * k rows received, balanced), two grouped
GEMMs per block (fc1 column-, fc2 row-parallel over the experts' tp group: tp at etp = tp, none at
etp = 1); the token group is the ranks routing the rest of the microbatch (cp; tp, or tp_cp at
etp = 1 under tp): tensorwise one [E] all-reduce where the dense linear has one 4-byte one
(x and g over the token group instead of cp); rowwise x and g [R], W [E*N] / [E*K] over the
experts' tp group, the weight gradient's [E*N] and [E*K] over the token group.

Blockwise runs at tp = cp = 1: nothing to reduce. Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.choices import Fp8ScalingRecipe
from megalite.config.model import GPTConfig
from megalite.plan.layout import local_seq_length, recomputed_stage_layers, stage_layers, zero_group_name, zero_shard_ranks
from megalite.plan.moe import routed_tokens, stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


class _Tally:
    """ledger group -> [all-reduces, bytes]; groups of one rank (None) issue nothing."""

    def __init__(self):
        self.out: dict[str, list[int]] = {}

    def add(self, group: str | None, count: int, nbytes_each: int) -> None:
        if group is not None and count > 0:
            entry = self.out.setdefault(group, [0, 0])
            entry[0] += count
            entry[1] += count * nbytes_each


def _linears(model: GPTConfig, cfg: RunConfig, mlp: bool) -> list[tuple[str, int, int, bool]]:
    """(kind, N, K, sequence parallel) of one block's FP8 linears on a tp rank: attention's QKV (MLA's two
    up-projections) and output, and with `mlp` the dense MLP's two; an MoE block's shared expert (non-SP) when it has one."""
    t, h, d, sp = cfg.parallel.tp, model.hidden_size, model.head_dim, cfg.parallel.sequence_parallel
    gated = model.flavour != "gpt2"
    if model.mla is not None:  # latent attention: two column-parallel up-projections (the down-projections stay plain)
        mla, n = model.mla, model.num_attention_heads
        out = [("column", n * mla.qk_dim // t, mla.q_lora_rank or h, sp),
               ("column", n * (mla.qk_head_dim + mla.v_head_dim) // t, mla.kv_lora_rank, sp),
               ("row", h, n * mla.v_head_dim // t, sp)]
    else:
        qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d // t
        out = [("column", qkv, h, sp), ("row", h, model.num_attention_heads * d // t, sp)]
    if mlp:
        f = model.ffn_hidden_size
        out += [("column", (2 if gated else 1) * f // t, h, sp), ("row", h, f // t, sp)]
    elif model.moe.shared_expert_intermediate_size:
        f = model.moe.shared_expert_intermediate_size
        out += [("column", (2 if gated else 1) * f // t, h, False), ("row", h, f // t, False)]
    return out


def _dense(tally: _Tally, cfg: RunConfig, linears, tokens: int, forwards: int, backwards: int) -> None:
    """The linears' reductions over `forwards` forward and `backwards` backward passes."""
    p = cfg.parallel
    tp, cp = ("tp" if p.tp > 1 else None), ("cp" if p.cp > 1 else None)
    gathered = p.zero == 3 and bool(cfg.precision.fp8_param_gather)  # the weight arrives cast: no W amax
    for kind, n, k, sp in linears:
        column = kind == "column"
        if cfg.precision.fp8_recipe == Fp8ScalingRecipe.ROWWISE:
            tally.add(tp, forwards * (not column), 4 * (tokens + n))
            tally.add(tp, backwards * column, 4 * (tokens + k))
            tally.add(cp, backwards, 4 * (n + k))
            continue
        replicated = column and not sp
        tally.add(tp, forwards * ((not replicated) + (not gathered)), 4)
        tally.add(tp, backwards * (column + (not gathered)), 4)
        tally.add(cp, forwards + backwards, 4)


def _experts(tally: _Tally, model: GPTConfig, cfg: RunConfig, forwards: int, backwards: int) -> None:
    """The grouped experts' reductions (two grouped GEMMs per MoE block) over the given passes."""
    moe, p = model.moe, cfg.parallel
    experts, etp, h = moe.num_experts // p.ep, cfg.etp_size, model.hidden_size
    expert_tp = "tp" if p.tp > 1 and etp == p.tp else None
    if cfg.experts_whole:
        token_group = "tp" if p.cp == 1 else "tp_cp"
    else:
        token_group = "cp" if p.cp > 1 else None
    f = moe.expert_ffn(model.ffn_hidden_size)
    rows = routed_tokens(model, cfg) * moe.topk
    gemms = [("column", (f if model.flavour == "gpt2" else 2 * f) // etp, h), ("row", h, f // etp)]
    for kind, n, k in gemms:
        column = kind == "column"
        if cfg.precision.fp8_recipe == Fp8ScalingRecipe.ROWWISE:
            tally.add(expert_tp, forwards * (not column), 4 * (rows + experts * n))
            tally.add(expert_tp, backwards * column, 4 * (rows + experts * k))
            tally.add(token_group, backwards, 4 * experts * (n + k))
            continue
        tally.add(expert_tp, forwards * (1 + (not column)) + backwards * (1 + column), 4 * experts)
        tally.add(token_group, forwards + backwards, 4 * experts)


def _parameter_gathers(tally: _Tally, model: GPTConfig, cfg: RunConfig, stage: int) -> None:
    """--fp8-param-gather: each gather of a block's unit all-reduces its FP8 weights' amaxes over
    the gather group, then over tp (the experts' units: not modelled)."""
    p, m = cfg.parallel, cfg.num_microbatches
    if not (p.zero == 3 and cfg.precision.fp8_param_gather and zero_shard_ranks(cfg) > 1):
        return
    if p.zero3_keep_gathered_in_step:
        gathers = 1
    else:
        gathers = 2 * m if p.zero3_reshard_after_forward else m
    layers, moe_layers = stage_layers(model, cfg)[stage], stage_moe_layers(model, cfg, stage)
    for count, mlp in ((layers - moe_layers, True), (moe_layers, False)):
        weights = len(_linears(model, cfg, mlp)) if count else 0
        tally.add(zero_group_name(cfg), gathers * count, 4 * weights)
        tally.add("tp" if p.tp > 1 else None, gathers * count, 4 * weights)


def amax_all_reduces(model: GPTConfig, cfg: RunConfig, stage: int) -> dict[str, tuple[int, int]]:
    """ledger group -> (all-reduces, bytes) of FP8's scales per step on a rank of stage `stage`
    (module docstring); {} without --fp8-format and under blockwise (tp = cp = 1)."""
    if cfg.precision.fp8_format is None or cfg.precision.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE:
        return {}
    m = cfg.num_microbatches
    layers, rerun = stage_layers(model, cfg)[stage], recomputed_stage_layers(model, cfg)[stage]
    moe_layers = stage_moe_layers(model, cfg, stage)
    moe_rerun = stage_moe_layers(model, cfg, stage, recomputed=True)
    tokens = local_seq_length(model, cfg) * cfg.training.micro_batch_size
    tally = _Tally()
    dense = (layers - moe_layers, rerun - moe_rerun)
    _dense(tally, cfg, _linears(model, cfg, mlp=True), tokens, m * sum(dense), m * dense[0])
    if moe_layers:
        _dense(tally, cfg, _linears(model, cfg, mlp=False), tokens, m * (moe_layers + moe_rerun), m * moe_layers)
        _experts(tally, model, cfg, m * (moe_layers + moe_rerun), m * moe_layers)
    _parameter_gathers(tally, model, cfg, stage)
    return {group: (count, nbytes) for group, (count, nbytes) in tally.out.items()}
