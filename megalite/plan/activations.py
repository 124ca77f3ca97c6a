"""Activation memory: the bytes megalite's own blocks keep for backward, per microbatch.

Counted storage by storage in the manner of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") for megalite's blocks and kernels, and checked
against the real model on CPU (tests/training/test_estimate.py), times the microbatches in
flight on the stage (1F1B: pp - stage; interleaved: Megatron's warmup + 1 chunks, of which only
chunk 0's hold the first stage's embedding; GPipe: all; ZB-H1: counted on the schedule; DualPipeV:
counted on the schedule, 2pp + 1 chunk-microbatches on every stage, the embedding's and the
head's both on stage 0).

Which attention implementation runs (kernels/attention_dispatch.py) changes what its core keeps:
the Triton kernels write their output where the out-projection reads it, SDPA's output is copied
there, and SDPA with repeated kv heads keeps the repeats (`planned_attention`, `output_kept_once`).

Context parallelism (cp > 1) gives each rank s/cp tokens of every sequence, so every
per-token term uses s/cp. What only exists at cp > 1 is added by name: the positions gathered at the zigzag chunks' global positions, and the ring's
or all-to-all's transient buffers (`context_parallel_buffer_bytes`, one layer's worth).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from megalite.config.choices import CPCommType, Recompute, Schedule
from megalite.config.model import GPTConfig
from megalite.plan import fp8
from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD
from megalite.pipeline.schedules import build_schedule, dualpipev_compute, interleaved_compute
from megalite.plan.mla import latent_layer_bytes
from megalite.plan.layout import (DTYPE_BYTES, head_stage, is_v_shaped, local_seq_length, recomputed_stage_layers,
                                  stage_layers)
from megalite.plan.moe import routing_activation_bytes, stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def _norm_bytes(model: GPTConfig, a: int, rows: int, h: int) -> int:
    """Kept by one norm kernel over `rows` tokens of width h: its input and fp32 statistics."""
    return a * rows * h + (2 if model.flavour == "gpt2" else 1) * 4 * rows   # mean+rstd | rstd


def _attention_inputs_bytes(model: GPTConfig, a: int, sb: int, t: int, recompute: str, ulysses: bool = False) -> int:
    """q, k, v as the attention core keeps them (storage-level: views keep the whole QKV output).

    Under Ulysses (`ulysses`) the kernel keeps views of the all-to-all's head-split copy, the
    same bytes as the QKV output, and the rotated q and k are consumed by that copy."""
    d, nq, nkv = model.head_dim, model.num_attention_heads // t, model.num_query_groups // t
    qkv_storage = a * sb * (nq + 2 * nkv) * d
    if recompute == Recompute.SELECTIVE:
        return qkv_storage                                      # only the checkpoint's input survives
    total = qkv_storage                                         # flash kernel: views of it, no repeat
    if model.flavour == "llama" and not ulysses:
        total += a * sb * (nq + nkv) * d                        # rotated q and k (new tensors)
    return total


ATTENTION_IMPLEMENTATIONS = ("triton", "sdpa", "sdpa_gqa", "reference")  # kernels/attention_dispatch.py's names


def planned_attention(model: GPTConfig, attention: str | None = None) -> str:
    """The attention implementation counted: `attention` where the caller knows which runs (the
    training loop asks the dispatch), else what `auto` may pick on a GPU that keeps the most:
    the Triton kernels with attention dropout (only they regenerate its mask), otherwise torch's
    SDPA with repeated kv heads (any GPU the dispatch table did not measure), an upper bound."""
    if attention is None:
        return "triton" if model.attention_dropout > 0.0 else "sdpa"
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, got {attention!r}")
    return attention


def output_kept_once(cfg: RunConfig, attention: str) -> bool:
    """Whether attention's output and the out-projection's input are one storage: the Triton kernels
    write their output in the [s, b, nq/t, d] memory the projection reads (q's own layout), so the
    core's permute back is a view. Not under context parallelism: ring attention merges contiguous
    blocks and Ulysses's all-to-all moves the output into a new tensor."""
    return attention == "triton" and cfg.parallel.cp == 1


def _repeats_kv_heads(model: GPTConfig, cfg: RunConfig, attention: str) -> bool:
    """SDPA with repeated heads keeps the repeated k, v; the CPU reference is that SDPA except with
    attention dropout (its own flash-style function, no repeat); ring attention runs Triton's blocks."""
    grouped = model.num_query_groups < model.num_attention_heads
    ring = cfg.parallel.cp > 1 and cfg.parallel.cp_comm_type == CPCommType.P2P
    sdpa = attention == "sdpa" or (attention == "reference" and model.attention_dropout == 0.0)
    return grouped and sdpa and not ring


def layer_activation_bytes(model: GPTConfig, cfg: RunConfig, recompute: str | None = None,
                           attention: str | None = None) -> int:
    """Bytes one block keeps for backward, per microbatch, on one tensor-parallel rank.

    Counted storage by storage from megalite's block (Korthikanti et al.'s method; their
    34*sbh + 5*a*s^2*b for GPT with Megatron's kernels). [s, b, h], t = tp, a = activation bytes;
    norm inputs and dropout masks are sharded by t only under sequence parallelism (sp):
      two norms: input a*sbh/sp + fp32 stats (the CPU RMSNorm reference keeps more);
      QKV and MLP-in linear inputs 2*a*sbh/sp (under SP the column-parallel linear keeps only
      its sequence shard and re-gathers it in backward, as Korthikanti et al. count it);
      q, k, v: the QKV output a*sb(nq+2nkv)d/t, rotated copies for RoPE; under grouped-query
      attention SDPA with repeated kv heads ("sdpa", and the CPU "reference" without dropout)
      keeps the repeated k and v, 2*a*sb*nq*d/t;
      attention output a*sbh/t + fp32 logsumexp 4*b*nq*s/t (flash attention, with or without
      dropout: the mask is regenerated from its Philox key in backward, nothing per score kept),
      and the out-projection's input a*sbh/t: the same storage where `attention` is "triton"
      (`output_kept_once`), else a copy [s, b, nq*d/t] of the [b, nq/t, s, d] output (torch's CUDA
      SDPA kernels allocate [b, s, nq/t, d]; where a torch kernel writes q's layout, as torch 2.13's
      CPU SDPA does, the block keeps a*sbh/t less than counted: an upper bound there);
      MLP: gpt2 fc1 and GeLU outputs 2*a*sbf/t; llama gate|up and product 3*a*sbf/t (+silu(gate)
      a*sbf/t with the PyTorch reference). Hidden dropout keeps no mask (bias-dropout-add
      regenerates it), so dropout adds no bytes anywhere.
    Selective recompute keeps the QKV output and the attention output; full recompute keeps the
    block input (and a few Python integers of dropout-stream state, no tensor).
    Under context parallelism s is this rank's s/cp tokens.
    """
    recompute = recompute or cfg.parallel.recompute
    attention = planned_attention(model, attention)
    a = DTYPE_BYTES[cfg.precision.precision]
    t = cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    s, b, h = local_seq_length(model, cfg), cfg.training.micro_batch_size, model.hidden_size
    ulysses = cfg.parallel.cp > 1 and cfg.parallel.cp_comm_type == CPCommType.A2A
    f, nq = model.ffn_hidden_size, model.num_attention_heads
    if recompute == Recompute.FULL:
        return a * s * b * h // sp
    if model.mla is not None:  # DeepSeek's latent attention (plan/mla.py); SDPA keeps its output once
        return (latent_layer_bytes(model, a=a, tokens=s * b, batch=b, seq=s, t=t, sp=sp, recompute=recompute)
                + fp8.attention_saved_change(model, cfg, recompute, True) + fp8.mlp_saved_change(model, cfg))
    total = 2 * _norm_bytes(model, a, s * b // sp, h)
    total += 2 * a * s * b * h // sp                                    # QKV and MLP-in linear inputs
    total += _attention_inputs_bytes(model, a, s * b, t, recompute, ulysses)
    total += a * s * b * nq * model.head_dim // t                       # out-proj input [s, b, nq*d/t]
    if recompute == Recompute.NONE:                                             # fp32 logsumexp [b, nq/t, s]
        total += 4 * b * nq * s // t
        if not output_kept_once(cfg, attention):                        # its own [b, nq/t, s, d] output
            total += a * s * b * nq * model.head_dim // t
        if _repeats_kv_heads(model, cfg, attention):                   # k, v repeated per query head
            total += 2 * a * s * b * nq * model.head_dim // t
    if model.flavour == "gpt2":
        total += 2 * a * s * b * f // t
    else:
        total += 3 * a * s * b * f // t
    if ulysses and recompute == Recompute.NONE:
        total += 2 * 8 * 2 * cfg.parallel.cp                            # int64 chunk orders of its two reorderings
    # FP8 tensorwise keeps the linears' inputs in 1 byte (plan/fp8.py)
    total += fp8.attention_saved_change(model, cfg, recompute, output_kept_once(cfg, attention))
    return total + fp8.mlp_saved_change(model, cfg)


def embedding_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Kept by the first stage's embedding per microbatch: token ids (+ local ids and mask when
    the vocabulary is split; its dropout keeps no mask), and under context parallelism gpt2's
    int64 global positions (the index of the position-table gather)."""
    s, b = local_seq_length(model, cfg), cfg.training.micro_batch_size
    n = 8 * s * b + (9 * s * b if cfg.parallel.tp > 1 else 0)
    if cfg.parallel.cp > 1 and model.flavour == "gpt2":
        n += 8 * s
    return n


def head_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Kept by the last stage per microbatch: final norm (its input is the last block's output),
    the output layer's input (the sequence shard under SP), and what the cross-entropy kernel keeps:
    the logits shard itself (not with --fused-linear-cross-entropy), the targets and one fp32
    log-sum-exp per token."""
    a = DTYPE_BYTES[cfg.precision.precision]
    s, b, h, t = local_seq_length(model, cfg), cfg.training.micro_batch_size, model.hidden_size, cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    n = _norm_bytes(model, a, s * b // sp, h)
    n += a * s * b * h // sp                                            # output-layer input
    if not cfg.parallel.fused_linear_cross_entropy:
        n += a * s * b * model.padded_vocab_size(t) // t                # logits shard, kept by the CE kernel
    n += 8 * s * b + 4 * s * b                                          # int64 targets, fp32 log-sum-exp
    return n


def mtp_activation_bytes(model: GPTConfig, cfg: RunConfig, attention: str | None = None) -> int:
    """Kept by the MTP depths per microbatch, on the head's stage, live while its loss head is (never
    recomputed): each depth's embedding of the ids k ahead (embedding_activation_bytes, less the ids at
    tp > 1), its enorm (the new embedding) and hnorm (whose input, the previous hidden state, the final norm or the previous depth
    already keeps: its statistics only), M_k's input [s', b, 2h] (the sequence shard under SP; and under SP
    M_k's gathered [s, b, h] output, whose view the block keeps), a whole block (an MoE one's routing
    buffers instead of the dense MLP's) and a loss head through its own final norm (head_activation_bytes)."""
    depths = model.mtp_num_layers
    if not depths:
        return 0
    a, h = DTYPE_BYTES[cfg.precision.precision], model.hidden_size
    rows_all = local_seq_length(model, cfg) * cfg.training.micro_batch_size  # s * b (s/cp under cp)
    rows = rows_all // (cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
    norms = 2 * _norm_bytes(model, a, rows, h) - a * rows * h  # enorm, hnorm (its input kept already)
    eh_input = 2 * a * rows * h                                 # M_k's input [s', b, 2h]
    # under SP the block's first norm keeps its [s/tp, b, h] input as a view of M_k's gathered [s, b, h] output
    # (the sequence split of a contiguous tensor is a view): the whole storage, (tp - 1) shards more
    whole = a * rows_all * h - a * rows * h
    # the embedding of the rolled ids: at tp > 1 its lookup keeps the local ids and the mask, not the ids
    embedded = embedding_activation_bytes(model, cfg) - (8 * rows_all if cfg.parallel.tp > 1 else 0)
    n = depths * (embedded + norms + eh_input + whole + head_activation_bytes(model, cfg)
                  + layer_activation_bytes(model, cfg, recompute="none", attention=attention))
    moe_depths = sum(model.is_moe_block(model.num_layers + k) for k in range(depths))
    return n + moe_depths * moe_activation_change(model, cfg)


def rope_table_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Llama under context parallelism: the fp32 cos and sin rows [s/cp, d] gathered at this
    rank's global positions, kept by the RoPE of every block of a chunk (views of the tables,
    nothing, at cp = 1)."""
    if cfg.parallel.cp == 1 or model.flavour != "llama":
        return 0
    return 2 * 4 * local_seq_length(model, cfg) * model.head_dim


def context_parallel_buffer_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Transient bytes of one layer's context-parallel attention at its peak (backward), per rank.

    Ring (p2p), with U = 2*b*h_kv*(s/cp)*d*a one packed K/V block (h, h_kv per tp rank):
      forward: the held and the arriving K/V (2U), one block's output and lse, and the fp32
      running output (when activations are not fp32; at fp32 it is the kept output itself);
      backward: fp32 dq 4*b*h*(s/cp)*d, the held and arriving K/V (2U), fp32 dK/dV accumulators
      held, sent and arriving (3 * 2*b*h_kv*(s/cp)*d*4) and one block's dq/dk/dv.
    Ulysses (a2a), with X = b*(s/cp)*d*a: forward the packed q/k/v pieces and their arrival
    (2 (h + 2h_kv) X) and the output's pieces and arrival (2 h X); backward the same.
    """
    p = cfg.parallel
    if p.cp == 1:
        return 0
    a, t = DTYPE_BYTES[cfg.precision.precision], p.tp
    s, b, d = local_seq_length(model, cfg), cfg.training.micro_batch_size, model.head_dim
    h, h_kv = model.num_attention_heads // t, model.num_query_groups // t
    if p.cp_comm_type == CPCommType.A2A:
        return 2 * (h + 2 * h_kv) * b * s * d * a + 2 * h * b * s * d * a
    unit = 2 * b * h_kv * s * d
    block = a * b * h * s * d + 4 * b * h * s                           # one block's output and lse
    forward = 2 * unit * a + block + (4 * b * h * s * d if a != 4 else 0)
    backward = 4 * b * h * s * d + 2 * unit * a + 3 * unit * 4 + a * b * (h + 2 * h_kv) * s * d
    return max(forward, backward)


@lru_cache(maxsize=4096)
def _zero_bubble_peak(pp: int, m: int, stage: int) -> int:
    """ZB-H1 keeps a microbatch's linear inputs until its deferred weight-gradient pass (W)."""
    live = peak = 0
    for op in build_schedule(Schedule.ZB_H1, pp, m)[stage]:
        live += (op.kind == FWD) - (op.kind == BWD_WEIGHT)
        peak = max(peak, live)
    return peak


@lru_cache(maxsize=1024)
def dualpipev_peak(pp: int, m: int, stage: int) -> tuple[int, int, int]:
    """DualPipeV on `stage`, counted on its compute order: (chunk-microbatches live at the peak, of
    them local chunk 0's, local chunk 1's). A microbatch's activations live from its FWD to its W (the
    linear layers' inputs wait for the weight pass, as ZB-H1's). Every stage peaks at 2pp + 1: the
    DualPipe report's PP + 1 for its PP = 2pp stages."""
    live, peak, at_peak = [0, 0], 0, (0, 0)
    for op in dualpipev_compute(pp, m, stage):
        live[op.chunk] += (op.kind == FWD) - (op.kind == BWD_WEIGHT)
        if sum(live) > peak:
            peak, at_peak = sum(live), tuple(live)
    return peak, *at_peak


def inflight_microbatches(cfg: RunConfig, stage: int) -> int:
    """Microbatches (model chunks for interleaving) whose activations a stage holds at its peak."""
    m, pp, v = cfg.num_microbatches, cfg.parallel.pp, cfg.parallel.virtual_stages
    if cfg.schedule == Schedule.GPIPE:
        return m * v
    if is_v_shaped(cfg):                                          # DualPipeV: counted on the schedule itself
        return dualpipev_peak(pp, m, stage)[0]
    if cfg.schedule == Schedule.ZB_H1:                           # counted on the schedule itself
        return _zero_bubble_peak(pp, m, stage)
    if v == 1:                                                      # 1f1b: warmup + 1
        return min(pp - stage, m)
    if m == pp:  # Megatron: every forward is warm-up (no steady state), all m*v run before the first backward
        return m * v
    return min((pp - stage - 1) * 2 + (v - 1) * pp + 1, m * v)     # Megatron's interleaved warmup + 1


def embedding_inflight_microbatches(cfg: RunConfig, stage: int) -> int:
    """Microbatches whose embedding activations the stage holds at its peak. The embedding belongs to
    model chunk 0 only: with v > 1 chunks that is chunk 0's share of the chunk-microbatches in flight,
    not all of them. Interleaved 1F1B runs its warm-up forwards in groups of pp microbatches per
    chunk, chunk 0 first (forward k is chunk (k // pp) % v), and peaks before its first backward."""
    m, pp, v = cfg.num_microbatches, cfg.parallel.pp, cfg.parallel.virtual_stages
    inflight = inflight_microbatches(cfg, stage)
    if v == 1:
        return min(inflight, m)
    if cfg.schedule == Schedule.GPIPE:
        return m
    if is_v_shaped(cfg):  # DualPipeV: the embedding is chunk 0's on stage 0
        return dualpipev_peak(pp, m, stage)[1]
    return sum(1 for k in range(inflight) if (k // pp) % v == 0)


def head_inflight_microbatches(cfg: RunConfig) -> int:
    """Microbatches whose loss-head activations the last stage holds at its peak: all of them under
    GPipe, one under 1F1B; interleaved, counted on the schedule: the last chunk's forwards not yet
    backward at the stage's peak (more than one when every forward is warm-up, m == pp)."""
    m, pp, v = cfg.num_microbatches, cfg.parallel.pp, cfg.parallel.virtual_stages
    if cfg.schedule == Schedule.GPIPE:
        return m
    if is_v_shaped(cfg):  # DualPipeV: the head is chunk 1's on stage 0
        return dualpipev_peak(pp, m, 0)[2]
    if cfg.schedule != Schedule.INTERLEAVED or v == 1:
        return 1
    return _interleaved_head_at_peak(pp, m, v)


@lru_cache(maxsize=1024)
def _interleaved_head_at_peak(pp: int, m: int, v: int) -> int:
    """head_inflight_microbatches' count on the interleaved schedule's last stage, cached: the
    planner's search asks it for every candidate of one (pp, m, v); the whole placed schedule at pp
    128 is 10^5 instructions and seconds to build, the last stage's compute 2mv instructions."""
    live, head, peak, head_at_peak = 0, 0, 0, 1
    for op in interleaved_compute(pp, m, v, pp - 1):  # the last stage's compute, as build_schedule orders it
        step = (op.kind == FWD) - (op.kind in (BWD, BWD_INPUT))
        live += step
        head += step if op.chunk == v - 1 else 0
        if live > peak:
            peak, head_at_peak = live, head
    return head_at_peak


def moe_activation_change(model: GPTConfig, cfg: RunConfig) -> int:
    """An MoE block's routing buffers minus the dense MLP activations it does not keep: the MLP's
    intermediates and its fc1 input (the norm output, a*sbh/sp): the experts run on permuted copies and
    the router on an fp32 copy (in fp32 on the tokens themselves: `moe.router_input_bytes`), all counted
    in `routing_activation_bytes` (a shared expert's input too)."""
    a, t = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    tokens = local_seq_length(model, cfg) * cfg.training.micro_batch_size
    dense = (2 if model.flavour == "gpt2" else 3) * a * tokens * model.ffn_hidden_size // t
    dense += a * tokens * model.hidden_size // sp  # the MLP-in linear's input
    dense += fp8.mlp_saved_change(model, cfg)  # as layer_activation_bytes counted the dense MLP under FP8
    return routing_activation_bytes(model, cfg) + fp8.expert_saved_change(model, cfg) - dense


def recomputed_block_bytes(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None) -> int:
    """What the block being recomputed keeps while its backward runs (0 without full recompute on the stage):
    a block run without recompute, an MoE block's routing buffers in place of the dense MLP's when the stage
    has one (the largest block it recomputes). torch's checkpoint holds these through its own saved-tensor
    hooks, live only during that block's backward."""
    if not recomputed_stage_layers(model, cfg)[stage]:
        return 0
    whole = layer_activation_bytes(model, cfg, recompute="none", attention=attention)
    if stage_moe_layers(model, cfg, stage):
        whole += max(0, moe_activation_change(model, cfg))
    return whole


def activation_bytes(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None, *,
                     recomputing: bool = True) -> int:
    """Peak saved-activation bytes of one rank of pipeline stage `stage` (`attention`: which
    implementation runs, see `planned_attention`). recomputing False: without the block full recompute
    re-runs (what autograd's saved-tensor hook sees: torch's checkpoint keeps it through its own hooks).
    On the last stage that block and the loss head of its microbatch are never live together (the
    microbatch's backward frees the head before it reaches the blocks); the head's other in-flight
    microbatches are, except under interleaving, where they are all counted beside it."""
    v, pp = cfg.parallel.virtual_stages, cfg.parallel.pp
    layers = stage_layers(model, cfg)[stage]
    recomputed = recomputed_stage_layers(model, cfg)[stage]  # full recompute: all, or N per chunk
    inflight = inflight_microbatches(cfg, stage)
    per_layer = layer_activation_bytes(model, cfg, attention=attention)
    kept_whole = layer_activation_bytes(model, cfg, recompute="none", attention=attention)
    moe_layers = stage_moe_layers(model, cfg, stage)
    if moe_layers and cfg.parallel.recompute != Recompute.FULL:  # routing buffers instead of the dense MLP's
        per_layer += moe_layers * moe_activation_change(model, cfg) // max(layers, 1)
    # with v chunks, each in-flight chunk-microbatch holds layers / v blocks
    if cfg.parallel.recompute == Recompute.FULL:
        total = inflight * (per_layer * recomputed + kept_whole * (layers - recomputed)) // v
    else:
        total = inflight * per_layer * layers // v
    total += inflight * rope_table_bytes(model, cfg) + context_parallel_buffer_bytes(model, cfg)
    if stage == 0:
        total += embedding_inflight_microbatches(cfg, stage) * embedding_activation_bytes(model, cfg)
    if stage != head_stage(cfg):  # the last stage; stage 0 under DualPipeV
        return total + (recomputed_block_bytes(model, cfg, stage, attention) if recomputing else 0)
    head = head_activation_bytes(model, cfg) + mtp_activation_bytes(model, cfg, attention)  # MTP's live beside it
    heads = head_inflight_microbatches(cfg) * head
    return total + heads + (recompute_beside_heads(model, cfg, stage, attention) if recomputing else 0)


def recompute_beside_heads(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None) -> int:
    """On the head's stage: what the block full recompute re-runs adds to the peak beyond the loss heads'
    in-flight microbatches (activation_bytes: max(heads * head, beside * head + block) - heads * head).
    Not live while the output layer runs its backward (plan/buffers.py counts that moment)."""
    block = recomputed_block_bytes(model, cfg, stage, attention)
    if not block:
        return 0
    heads = head_inflight_microbatches(cfg)
    head = head_activation_bytes(model, cfg) + mtp_activation_bytes(model, cfg, attention)
    beside = heads if cfg.schedule == Schedule.INTERLEAVED and cfg.parallel.virtual_stages > 1 else heads - 1
    return max(0, beside * head + block - heads * head)
