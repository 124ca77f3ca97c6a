"""Activation memory: the bytes megalite's own blocks keep for backward, per microbatch.

Counted storage by storage in the manner of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") for megalite's blocks and kernels, and checked
against the real model on CPU (tests/training/test_estimate.py), times the microbatches in
flight on the stage (1F1B: pp - stage; interleaved: Megatron's warmup + 1 chunks, of which only
chunk 0's hold the first stage's embedding; GPipe: all; ZB-H1: counted on the schedule).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.model.config import GPTConfig
from megalite.pipeline.instructions import BWD_WEIGHT, FWD
from megalite.pipeline.schedules import build_schedule
from megalite.plan.layout import DTYPE_BYTES, recomputed_stage_layers, stage_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def _norm_bytes(model: GPTConfig, a: int, rows: int, h: int) -> int:
    """Kept by one norm kernel over `rows` tokens of width h: its input and fp32 statistics."""
    return a * rows * h + (2 if model.flavour == "gpt2" else 1) * 4 * rows   # mean+rstd | rstd


def _attention_inputs_bytes(model: GPTConfig, a: int, sb: int, t: int, recompute: str) -> int:
    """q, k, v as the attention core keeps them (storage-level: views keep the whole QKV output)."""
    d, nq, nkv = model.head_dim, model.num_attention_heads // t, model.num_query_groups // t
    qkv_storage = a * sb * (nq + 2 * nkv) * d
    if recompute == "selective":
        return qkv_storage                                      # only the checkpoint's input survives
    total = qkv_storage                                         # flash kernel: views of it, no repeat
    if model.flavour == "llama":
        total += a * sb * (nq + nkv) * d                        # rotated q and k (new tensors)
    return total


def layer_activation_bytes(model: GPTConfig, cfg: RunConfig, recompute: str | None = None) -> int:
    """Bytes one block keeps for backward, per microbatch, on one tensor-parallel rank.

    Counted storage by storage from megalite's block (Korthikanti et al.'s method; their
    34*sbh + 5*a*s^2*b for GPT with Megatron's kernels). [s, b, h], t = tp, a = activation bytes;
    norm inputs and dropout masks are sharded by t only under sequence parallelism (sp):
      two norms: input a*sbh/sp + fp32 stats (the CPU RMSNorm reference keeps more);
      QKV and MLP-in linear inputs 2*a*sbh/sp (under SP the column-parallel linear keeps only
      its sequence shard and re-gathers it in backward, as Korthikanti et al. count it);
      q, k, v: the QKV output a*sb(nq+2nkv)d/t, rotated copies for RoPE, k and v repeated per
      query head under grouped-query attention (functional.attention's repeat_interleave);
      attention output a*sbh/t + fp32 logsumexp 4*b*nq*s/t (flash attention, with or without
      dropout: the mask is regenerated from its Philox key in backward, nothing per score kept);
      MLP: gpt2 fc1 and GeLU outputs 2*a*sbf/t; llama gate|up and product 3*a*sbf/t (+silu(gate)
      a*sbf/t with the PyTorch reference). Hidden dropout keeps no mask (bias-dropout-add
      regenerates it), so dropout adds no bytes anywhere.
    Selective recompute keeps the QKV output and the attention output; full recompute keeps the
    block input (and a few Python integers of dropout-stream state, no tensor).
    """
    recompute = recompute or cfg.parallel.recompute
    a = DTYPE_BYTES[cfg.precision.precision]
    t = cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    s, b, h = model.seq_length, cfg.training.micro_batch_size, model.hidden_size
    f, nq = model.ffn_hidden_size, model.num_attention_heads
    if recompute == "full":
        return a * s * b * h // sp
    total = 2 * _norm_bytes(model, a, s * b // sp, h)
    total += 2 * a * s * b * h // sp                                    # QKV and MLP-in linear inputs
    total += _attention_inputs_bytes(model, a, s * b, t, recompute)
    total += a * s * b * nq * model.head_dim // t                       # out-proj input [s, b, nq*d/t]
    if recompute == "none":                                             # flash: its own [b, nq/t, s, d]
        total += a * s * b * nq * model.head_dim // t + 4 * b * nq * s // t   # output, fp32 logsumexp
    if model.flavour == "gpt2":
        total += 2 * a * s * b * f // t
    else:
        total += 3 * a * s * b * f // t
    return total


def embedding_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Kept by the first stage's embedding per microbatch: token ids (+ local ids and mask when
    the vocabulary is split); its dropout keeps no mask."""
    s, b = model.seq_length, cfg.training.micro_batch_size
    return 8 * s * b + (9 * s * b if cfg.parallel.tp > 1 else 0)


def head_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Kept by the last stage per microbatch: final norm (its input is the last block's output),
    the output layer's input (the sequence shard under SP), and what the cross-entropy kernel keeps:
    the logits shard itself (not with --fused-linear-cross-entropy), the targets and one fp32
    log-sum-exp per token."""
    a = DTYPE_BYTES[cfg.precision.precision]
    s, b, h, t = model.seq_length, cfg.training.micro_batch_size, model.hidden_size, cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    n = _norm_bytes(model, a, s * b // sp, h)
    n += a * s * b * h // sp                                            # output-layer input
    if not cfg.parallel.fused_linear_cross_entropy:
        n += a * s * b * model.padded_vocab_size(t) // t                # logits shard, kept by the CE kernel
    n += 8 * s * b + 4 * s * b                                          # int64 targets, fp32 log-sum-exp
    return n


def _zero_bubble_peak(pp: int, m: int, stage: int) -> int:
    """ZB-H1 keeps a microbatch's linear inputs until its deferred weight-gradient pass (W)."""
    live = peak = 0
    for op in build_schedule("zb-h1", pp, m)[stage]:
        live += (op.kind == FWD) - (op.kind == BWD_WEIGHT)
        peak = max(peak, live)
    return peak


def inflight_microbatches(cfg: RunConfig, stage: int) -> int:
    """Microbatches (model chunks for interleaving) whose activations a stage holds at its peak."""
    m, pp, v = cfg.num_microbatches, cfg.parallel.pp, cfg.parallel.virtual_stages
    if cfg.schedule == "gpipe":
        return m * v
    if cfg.schedule == "zb-h1":                           # counted on the schedule itself
        return _zero_bubble_peak(pp, m, stage)
    if v == 1:                                                      # 1f1b: warmup + 1
        return min(pp - stage, m)
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
    if cfg.schedule == "gpipe":
        return m
    return sum(1 for k in range(inflight) if (k // pp) % v == 0)


def activation_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Peak saved-activation bytes of one rank of pipeline stage `stage`."""
    v, pp = cfg.parallel.virtual_stages, cfg.parallel.pp
    layers = stage_layers(model, cfg)[stage]
    recomputed = recomputed_stage_layers(model, cfg)[stage]  # full recompute: all, or N per chunk
    inflight = inflight_microbatches(cfg, stage)
    per_layer = layer_activation_bytes(model, cfg)
    kept_whole = layer_activation_bytes(model, cfg, recompute="none")
    # with v chunks, each in-flight chunk-microbatch holds layers / v blocks
    if cfg.parallel.recompute == "full":
        total = inflight * (per_layer * recomputed + kept_whole * (layers - recomputed)) // v
    else:
        total = inflight * per_layer * layers // v
    if recomputed:
        total += kept_whole  # the block being recomputed
    head_inflight = cfg.num_microbatches if cfg.schedule == "gpipe" else 1
    if stage == 0:
        total += embedding_inflight_microbatches(cfg, stage) * embedding_activation_bytes(model, cfg)
    if stage == pp - 1:
        total += head_inflight * head_activation_bytes(model, cfg)
    return total
