"""ZeRO-3 in the planner: units, the bytes of gathered units, and the data-parallel traffic.

megalite's ZeRO-3 (megalite/data_parallel/zero3.py) gathers one unit at a time: the embedding
(word + position tables), each transformer block, the final norm with the output layer (a
weight tied across pipeline stages is a unit of its own). An MoE block is two units (GPTModel.
zero3_units): the block without its experts, then its local experts, sharded over the
expert-data-parallel group (their traffic: group "edp", the same formulas with Ψ the stage's
expert parameters). Per rank of a pipeline stage, with
Ψ its tp-local parameters, p bytes per parameter element, m microbatches per step:

    parameters   p·Ψ/dp (the shard) + the units gathered at the peak: the running one and
                 `prefetch` ahead (+ the embedding the tied head borrows at pp = 1); every unit
                 of the stage with --zero3-keep-gathered-in-step or without reshard-after-forward
    gradients    4·Ψ/dp (fp32 shard) + 4·2·largest unit (one filling, one being reduce-scattered;
                 an MoE stage: its experts unit beside the largest other one)
    optimizer    8·Ψ/dp in fp32 (the parameter shard is the master), 12·Ψ/dp otherwise

    dp traffic per step (comm.ledger sizes, group "dp", or "dp_cp" with context parallelism, over
    which the shards are spread, or "dp_shard" under hybrid sharding, which then adds the step's
    fp32 gradient shard all-reduced once over "dp_replicate"; unit sizes padded to a multiple of dp
    at run time):
      all_gather      2·m·Ψ·p  reshard after forward (forward and backward of every microbatch)
                        m·Ψ·p  --no-zero3-reshard-after-forward
                               (--fp8-param-gather: the blocks' linear weights count 1 byte, plan/fp8.py) (at most: microbatches in flight
                               in a pipeline share a gather)
                          Ψ·p  --zero3-keep-gathered-in-step
                      + 2·m·Ψ_embedding·p for GPT-2's tied head at pp = 1 (it borrows the embedding)
      reduce_scatter  m·Ψ·g    every microbatch (g: --grad-reduce-dtype bytes)

Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan import fp8
from megalite.plan.layout import (DTYPE_BYTES, chunk_placement_of, head_stage, is_hybrid, stage_layers, zero_group_name,
                                  zero_shard_ranks)
from megalite.plan.moe import dense_change_per_layer, expert_dp_config, expert_params_per_layer, stage_moe_layers
from megalite.plan.params import layer_params
from megalite.pipeline.partition import stage_layers as partition_stage_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def embedding_unit(model: GPTConfig, cfg: RunConfig) -> int:
    """Elements of the first stage's embedding unit(s): the word table shard (+ GPT-2's positions)."""
    h, tp = model.hidden_size, cfg.parallel.tp
    return model.padded_vocab_size(tp) // tp * h + (model.seq_length * h if model.flavour == "gpt2" else 0)


def stage_units(model: GPTConfig, cfg: RunConfig, stage: int) -> list[int]:
    """Elements per rank of each unit of pipeline stage `stage`, in execution order (an MoE block:
    the block without its experts, then its experts)."""
    h, tp, pp = model.hidden_size, cfg.parallel.tp, cfg.parallel.pp
    units = [embedding_unit(model, cfg)] if stage == 0 else []
    if model.moe is None:
        units += [layer_params(model, tp)] * stage_layers(model, cfg)[stage]
    else:
        for layer_id in _stage_layer_ids(model, cfg, stage):
            if model.moe.is_moe_layer(layer_id):
                units += [layer_params(model, tp) + dense_change_per_layer(model, cfg),
                          expert_params_per_layer(model, cfg)]
            else:
                units.append(layer_params(model, tp))
    if stage == head_stage(cfg):  # the last stage; stage 0 under DualPipeV
        head = 2 * h if model.flavour == "gpt2" else h
        if not model.tie_embeddings or pp > 1:
            head += model.padded_vocab_size(tp) // tp * h
        units.append(head)
    return units


def _stage_layer_ids(model: GPTConfig, cfg: RunConfig, stage: int) -> list[int]:
    """The global indices of the blocks stage `stage` holds, chunk by chunk (the model's own split)."""
    p = cfg.parallel
    if p.pp == 1:
        return list(range(model.num_layers))
    ranges = partition_stage_layers(model.num_layers, p.pp, p.virtual_stages, stage, p.decoder_first_stage_layers,
                                    p.decoder_last_stage_layers, p.pipeline_layout,
                                    placement=chunk_placement_of(cfg))
    return [i for r in ranges for i in r]


def borrows_embedding(model: GPTConfig, cfg: RunConfig) -> bool:
    """GPT-2's tied head reads the word embedding of its own stage (pp = 1): gathered on demand."""
    return model.tie_embeddings and cfg.parallel.pp == 1


def gathered_peak_elements(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Most parameter elements gathered at once on a rank of `stage` (an upper bound)."""
    units = stage_units(model, cfg, stage)
    p = cfg.parallel
    if p.zero3_keep_gathered_in_step or not p.zero3_reshard_after_forward:
        return sum(units)
    window = min(len(units), p.zero3_prefetch + 1)  # the running unit and `prefetch` ahead
    peak = max(sum(units[i:i + window]) for i in range(len(units) - window + 1))
    if borrows_embedding(model, cfg):  # the head's backward: head, borrowed embedding, prefetched blocks
        peak = max(peak, units[-1] + units[0] + sum(units[max(1, len(units) - 1 - p.zero3_prefetch):-1]))
    return peak


def transient_grad_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """fp32 full gradients alive at once: the unit filling and the one being reduce-scattered (the unit
    before it in the backward; data_parallel/unit_grads.py keeps one reduction in flight), at most
    twice the largest unit. An MoE block's experts unit fills beside its own block's unit or the next
    one (or the head), never beside another experts unit: experts + the largest other unit."""
    units = stage_units(model, cfg, stage)
    if model.moe is None or not stage_moe_layers(model, cfg, stage):
        return 4 * 2 * max(units)
    experts = expert_params_per_layer(model, cfg)
    others = [u for u in units if u != experts] or [0]
    return 4 * max(2 * max(others), experts + max(others))


def add_zero3_dp_bytes(add, model: GPTConfig, cfg: RunConfig, stage: int, params: int) -> None:
    """ZeRO-3's dp traffic of one step (see the module docstring), into `add(key, bytes)`."""
    p, g = DTYPE_BYTES[cfg.precision.precision], DTYPE_BYTES[cfg.precision.grad_reduce_dtype]
    m, par, group = cfg.num_microbatches, cfg.parallel, zero_group_name(cfg)
    if zero_shard_ranks(cfg) == 1:  # hybrid sharding at S = 1, cp = 1: nothing sharded, nothing gathered
        return
    add(f"{group}/reduce_scatter", m * params * g)
    if par.zero3_keep_gathered_in_step:
        add(f"{group}/all_gather", fp8.param_gather_bytes(model, cfg, params, stage, p))
        return
    gathers = 2 * m if par.zero3_reshard_after_forward else m
    borrowed = 2 * m * embedding_unit(model, cfg) if borrows_embedding(model, cfg) and stage == 0 and \
        par.zero3_reshard_after_forward else 0
    add(f"{group}/all_gather", gathers * fp8.param_gather_bytes(model, cfg, params, stage, p) + borrowed * p)


def add_zero3_expert_bytes(add, cfg: RunConfig, experts: int) -> None:
    """ZeRO-3's traffic of a stage's expert units (`experts` elements per rank) over the expert-data-
    parallel group, into `add("edp/<op>", bytes)`: as the dense units', every microbatch reduce-
    scatters their gradients and gathers them for forward and backward (see the module docstring)."""
    edp = expert_dp_config(cfg)
    if edp.dp == 1:  # one replica: nothing to gather or reduce
        return
    p, g = DTYPE_BYTES[cfg.precision.precision], DTYPE_BYTES[cfg.precision.grad_reduce_dtype]
    m, par = cfg.num_microbatches, cfg.parallel
    if is_hybrid(edp):  # the step's fp32 expert shard across the replicas, once
        add("dp_replicate/all_reduce", 4 * -(-experts // edp.dp_shard))
    group = "edp_shard" if is_hybrid(edp) else "edp"
    if edp.dp_shard == 1:
        return
    add(f"{group}/reduce_scatter", m * experts * g)
    if par.zero3_keep_gathered_in_step:
        gathers = 1
    else:
        gathers = 2 * m if par.zero3_reshard_after_forward else m
    add(f"{group}/all_gather", gathers * experts * p)
