"""Know before you launch: per-rank memory, communication, FLOPs and bubble of a layout.

Pure arithmetic on a `GPTConfig` and a `Layout`; no torch, no process group. Used by
`tools/plan.py`, by `pretrain_gpt --dry-run`, and by `planner.py` (pre-flight checks before any
process group exists, the step-time model, layout suggestions).

Units: everything is in bytes (and FLOPs). Human-readable output uses GB = 1e9 bytes, the
convention of the ZeRO paper (Rajbhandari et al. 2020), whose worked example this module
reproduces: 7.5B parameters, Nd = 64, fp16 params and grads, Adam with K = 12 bytes/param of
optimizer state -> 120 / 31.4 / 16.6 / 1.9 GB per GPU for ZeRO stage 0 / 1 / 2 / 3.

Model states per parameter held by a rank, as megalite's DP engine and distributed optimizer
keep them (see `model_state_bytes`; --num-params uses the ZeRO paper's accounting instead):
  params  2 (bf16/fp16) or 4 (fp32)
  grads   4 (fp32 main grads) + 4/dp (the reduced shard, ZeRO >= 1)
  optim   12 (fp32 master + Adam m, v) / dp with ZeRO >= 1; in host memory when offloaded

Activations: what megalite's own blocks keep for backward per microbatch, counted storage by
storage in the manner of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"; see `layer_activation_bytes`) and checked against the real model on CPU
(tests/training/test_estimate.py), times the microbatches in flight on the stage (1F1B:
pp - stage; interleaved: Megatron's warmup + 1 chunks; GPipe: all; ZB-H1: counted on the
schedule). The estimate is for the worst stage. Transient buffers (gradients in flight,
communication buffers, allocator fragmentation) are left to `Estimate.fits`' headroom.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megalite.model.config import GPTConfig
from megalite.training.activation_memory import activation_bytes, inflight_microbatches
from megalite.training.run_layout import (DTYPE_BYTES, GB, RECOMPUTE_CHOICES, SCHEDULE_CHOICES, Layout,
                                          recompute_fraction, recomputed_stage_layers, stage_layers)


@dataclass
class Estimate:
    """Per-rank estimate for the worst pipeline stage (bytes, FLOPs, seconds-free)."""

    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    params_per_rank: int
    stage: int
    layers_on_stage: int
    inflight_microbatches: int
    num_microbatches: int
    bubble_fraction: float
    """Idle fraction of a step for the pipeline (see `bubble_fraction`)."""
    comm_bytes: dict[str, int] = field(default_factory=dict)
    """'group/op' -> bytes per step on this rank, in comm.ledger's (nccl-tests) size convention."""
    flops_per_step: float = 0.0
    """Model FLOPs of one optimizer step over the whole job (6N + 12*L*h*s per token)."""
    hardware_flops_per_step: float = 0.0
    """FLOPs actually executed, recomputation included."""
    tokens_per_step: int = 0
    host_bytes: int = 0
    """Bytes kept in host memory per rank (offloaded optimizer state)."""
    stage_totals: list[int] = field(default_factory=list)
    """total_bytes of every pipeline stage (the estimate reports the largest)."""

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes + self.activation_bytes

    def fits(self, gpu_memory: float, headroom: float = 0.1) -> bool:
        """True when total_bytes fits in (1 - headroom) of gpu_memory bytes (the rest: CUDA
        context, NCCL buffers, allocator fragmentation, transient tensors)."""
        return self.total_bytes <= (1.0 - headroom) * gpu_memory

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total_bytes"] = self.total_bytes
        return out

    def describe(self, gpu_memory: float | None = None) -> str:
        """A readable per-rank table in GB (1e9 bytes)."""
        rows = [("parameters", self.param_bytes), ("gradients", self.grad_bytes),
                ("optimizer state", self.optimizer_state_bytes), ("activations", self.activation_bytes),
                ("total", self.total_bytes)]
        lines = [f"per rank (pipeline stage {self.stage}, {self.layers_on_stage} layers, "
                 f"{self.inflight_microbatches} of {self.num_microbatches} microbatches in flight):"]
        lines += [f"  {name:<16} {n / GB:10.3f} GB" for name, n in rows]
        if self.host_bytes:
            lines.append(f"  {'host (offload)':<16} {self.host_bytes / GB:10.3f} GB")
        if gpu_memory:
            verdict = "fits" if self.fits(gpu_memory) else "does NOT fit"
            lines.append(f"  {verdict} in {gpu_memory / GB:.1f} GB (keeping 10% headroom)")
        lines.append(f"pipeline bubble: {100 * self.bubble_fraction:.1f}% of the step")
        lines.append(f"FLOPs per step: {self.flops_per_step:.3e} model, {self.hardware_flops_per_step:.3e} executed")
        for key, n in sorted(self.comm_bytes.items()):
            lines.append(f"  comm {key:<24} {n / GB:10.4f} GB/step")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Parameters per rank
# ---------------------------------------------------------------------------------------------


def layer_params(model: GPTConfig, tp: int) -> int:
    """Parameters of one transformer block held by one tensor-parallel rank."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    norm = 2 * h if model.flavour == "gpt2" else h            # LayerNorm weight+bias | RMSNorm weight
    mlp_in = f if model.flavour == "gpt2" else 2 * f           # fc1 | fused gate+up
    n = 2 * norm + h * qkv // tp + model.num_attention_heads * d * h // tp
    n += (h * mlp_in + f * h) // tp
    if model.add_bias:  # column-parallel biases are sharded, row-parallel biases replicated
        n += (qkv + mlp_in) // tp + 2 * h
    return n


def stage_params(model: GPTConfig, layout: Layout, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (padded vocabulary included)."""
    h, tp, pp = model.hidden_size, layout.tp, layout.pp
    n = stage_layers(model, layout)[stage] * layer_params(model, tp)
    vocab_shard = model.padded_vocab_size(tp) // tp * h
    final_norm = 2 * h if model.flavour == "gpt2" else h
    if stage == 0:
        n += vocab_shard + (model.seq_length * h if model.flavour == "gpt2" else 0)
    if stage == pp - 1:
        n += final_norm
        # untied: an output layer; tied with pp > 1: the last stage keeps its own copy of the
        # word embedding, kept in sync by an all-reduce of its gradient over the embedding group
        if not model.tie_embeddings or pp > 1:
            n += vocab_shard
    return n


# ---------------------------------------------------------------------------------------------
# Communication per step (comm.ledger's convention: all_reduce the tensor, all_gather the
# gathered output, reduce_scatter the full input, send/recv the tensor)
# ---------------------------------------------------------------------------------------------


def communication_bytes(model: GPTConfig, layout: Layout, stage: int) -> dict[str, int]:
    """'group/op' -> bytes per optimizer step on one rank of pipeline stage `stage`."""
    a, t, m, v = DTYPE_BYTES[layout.precision], layout.tp, layout.microbatches(), layout.virtual_stages
    s, b, h = layout.seq_length or model.seq_length, layout.micro_batch_size, model.hidden_size
    pp, sp = layout.pp, layout.sequence_parallel
    u = a * s * b * h                      # one full [s, b, h] activation
    out: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        if n:
            out[key] = out.get(key, 0) + n

    if t > 1:
        layers = stage_layers(model, layout)[stage]
        # Full recompute re-runs a block's forward until its last saved tensor is packed (torch's
        # non-reentrant checkpoint stops there, after the MLP output GEMM): both input gathers
        # and the attention output's reduction again, not the MLP output's reduction.
        rerun = recomputed_stage_layers(model, layout)[stage]
        if sp:
            # fwd: all-gather before QKV and MLP-in, reduce-scatter after out-proj and MLP-out;
            # bwd: the transposes, plus QKV and MLP-in re-gather the input shard they kept
            add("tp/all_gather", m * (6 * layers + 2 * rerun) * u)
            add("tp/reduce_scatter", m * (4 * layers + rerun) * u)
        else:
            add("tp/all_reduce", m * (4 * layers + rerun) * u)   # Megatron's 4 per layer
        if stage == 0:  # vocab-parallel embedding: fwd reduce (-scatter); bwd its transpose under SP
            add("tp/reduce_scatter" if sp else "tp/all_reduce", m * u)
            add("tp/all_gather", m * u if sp else 0)
        if stage == pp - 1:
            if sp:
                add("tp/all_gather", 2 * m * u)                         # output-layer input, fwd + bwd
                add("tp/reduce_scatter", m * u)                         # and its gradient
            else:
                add("tp/all_reduce", m * u)                             # grad of the copied input
            add("tp/all_reduce", m * (2 * t + 1) * 4 * s * b)           # CE: per-rank max, sum-exp; target
        add("tp/all_reduce", sequence_parallel_grad_bytes(model, layout, stage))

    params = stage_params(model, layout, stage)
    add_dp_bytes(add, params, layout)
    if pp > 1 and model.tie_embeddings and stage in (0, pp - 1):
        grad_bytes = DTYPE_BYTES[layout.grad_reduce_dtype or "fp32"]
        add("embedding/all_reduce", model.padded_vocab_size(t) // t * h * grad_bytes)
    if pp > 1:
        chunk = u // (t if sp else 1)
        first, last = stage == 0, stage == pp - 1
        fwd_send = m * (v - 1 if last else v)
        fwd_recv = m * (v - 1 if first else v)
        add("pp/send", chunk * (fwd_send + fwd_recv))   # activations forward, grads back
        add("pp/recv", chunk * (fwd_recv + fwd_send))
    return out


def sequence_parallel_grad_bytes(model: GPTConfig, layout: Layout, stage: int) -> int:
    """Under SP the norms' (and gpt2's position table's) gradients are partial per tp rank; the
    DP engine all-reduces them over tp once per step (fp32 main grads)."""
    if not layout.sequence_parallel or layout.tp == 1:
        return 0
    h = model.hidden_size
    norm = 2 * h if model.flavour == "gpt2" else h
    n = 2 * norm * stage_layers(model, layout)[stage]
    if stage == layout.pp - 1:
        n += norm
    if stage == 0 and model.flavour == "gpt2":
        n += model.seq_length * h
    return n * DTYPE_BYTES[layout.grad_reduce_dtype or "fp32"]


def add_dp_bytes(add, params: int, layout: Layout) -> None:
    """Data-parallel traffic for `params` parameters on this rank."""
    if layout.dp == 1:
        return
    p, g, m = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.grad_reduce_dtype or "fp32"], layout.microbatches()
    if layout.zero_stage == 0:
        add("dp/all_reduce", params * g)
    elif layout.zero_stage == 1:
        add("dp/reduce_scatter", params * g)        # once per step, in grad_reduce_dtype
        add("dp/all_gather", params * p)            # updated params after the sharded step
    elif layout.zero_stage == 2:
        add("dp/reduce_scatter", params * g)        # also once, during the last microbatch
        add("dp/all_gather", params * p)
    else:
        add("dp/reduce_scatter", m * params * g)
        add("dp/all_gather", 2 * m * params * p)    # params gathered for forward and backward


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: bytes on the busiest link per byte of ledger size."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, recv, broadcast


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def hardware_flops_per_token(model: GPTConfig, recompute: str, seq_length: int | None = None,
                             recompute_fraction: float = 1.0) -> float:
    """FLOPs executed per token including recomputation (HFU's numerator).

    Model FLOPs are 6N + 12*L*h*s; selective recompute re-runs the attention core forward
    (4*L*h*s); full recompute re-runs every block's forward GEMMs (2*N_blocks + 4*L*h*s; torch's
    non-reentrant checkpoint stops right after the last one, skipping only the MLP output's tp
    reduction), or that `recompute_fraction` of the blocks (--recompute-num-layers).
    """
    s = seq_length or model.seq_length
    flops = model.flops_per_token(s)
    attention_forward = 4.0 * model.num_layers * model.hidden_size * s
    if recompute == "selective":
        flops += attention_forward
    elif recompute == "full":
        flops += recompute_fraction * (2.0 * model.num_params(include_embedding=False) + attention_forward)
    return flops


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


def model_state_bytes(params: int, layout: Layout, convention: str = "megalite") -> tuple[int, int, int, int]:
    """(param, grad, optimizer-on-GPU, host) peak bytes for `params` parameters on one rank.

    "megalite" (megalite.optim.distributed_optimizer's table): fp32 master + Adam moments
    (12 bytes) in every precision, /dp with ZeRO >= 1; fp32 main grads (4 bytes whatever
    grad_reduce_dtype, which only sets the reduction's wire dtype) plus, with ZeRO >= 1, the
    reduced fp32 shard (4/dp). ZeRO-2 frees a bucket's full gradient only once its reduction
    (started during the last microbatch's backward) completes, so the full buffer still exists
    at the end of the backward: its peak is ZeRO-1's (it saves memory between steps, e.g. for
    the next forward, which this per-rank peak does not credit).
    "zero-paper" (Rajbhandari et al. 2020): grads in grad_reduce_dtype, K = 12 (mixed) or 8
    (fp32) optimizer bytes, ZeRO-1/2/3 partition optimizer / + grads / + params over dp.
    """
    p = DTYPE_BYTES[layout.precision]
    z, shard = layout.zero_stage, math.ceil(params / layout.dp)
    if convention == "zero-paper":
        g = DTYPE_BYTES[layout.grad_reduce_dtype or "fp32"]
        optimizer = (shard if z >= 1 else params) * (8 if layout.precision == "fp32" else 12)
        grads = (shard if z >= 2 else params) * g
    else:
        optimizer = (shard if z >= 1 else params) * 12
        grads = 4 * params + (4 * shard if z >= 1 else 0)
    weights = (shard if z >= 3 else params) * p
    if layout.offload_optimizer:
        return weights, grads, 0, optimizer
    return weights, grads, optimizer, 0


def _check_choices(layout: Layout) -> None:
    for name, value, choices in (("precision", layout.precision, tuple(DTYPE_BYTES)),
                                 ("grad_reduce_dtype", layout.grad_reduce_dtype or "fp32", tuple(DTYPE_BYTES)),
                                 ("recompute", layout.recompute, RECOMPUTE_CHOICES),
                                 ("schedule", layout.schedule_name(), SCHEDULE_CHOICES),
                                 ("zero_stage", layout.zero_stage, (0, 1, 2, 3)),
                                 ("device", layout.device, ("cuda", "cpu"))):
        if value not in choices:
            raise ValueError(f"{name}={value!r} is not supported; choose from {list(choices)}")
    for name in ("tp", "pp", "dp", "virtual_stages", "micro_batch_size"):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def bubble_fraction(layout: Layout) -> float:
    """Idle fraction of a step: (p-1)/(v*m + p-1) for 1F1B/interleaved/GPipe, (p-1)/(3m + p-1)
    for ZB-H1 (its F, B and W passes each fill a third of a 1F1B slot)."""
    p, m = layout.pp, layout.microbatches()
    slots = 3 * m if layout.schedule_name() == "zb-h1" else layout.virtual_stages * m
    return (p - 1) / (slots + p - 1)


def estimate(model: GPTConfig, layout: Layout) -> Estimate:
    """Per-rank memory, communication, bubble and FLOPs for the worst pipeline stage."""
    _check_choices(layout)
    seq = layout.seq_length or model.seq_length
    per_stage = []
    for stage in range(layout.pp):
        weights, grads, optimizer, host = model_state_bytes(
            stage_params(model, layout, stage), layout)
        per_stage.append((weights + grads + optimizer + activation_bytes(model, layout, stage), stage))
    _, worst = max(per_stage)
    params = stage_params(model, layout, worst)
    weights, grads, optimizer, host = model_state_bytes(params, layout)
    m = layout.microbatches()
    tokens = layout.global_batch() * seq
    return Estimate(
        param_bytes=weights, grad_bytes=grads, optimizer_state_bytes=optimizer,
        activation_bytes=activation_bytes(model, layout, worst), params_per_rank=params, stage=worst,
        layers_on_stage=stage_layers(model, layout)[worst],
        inflight_microbatches=inflight_microbatches(layout, worst), num_microbatches=m,
        bubble_fraction=bubble_fraction(layout),
        comm_bytes=communication_bytes(model, layout, worst),
        flops_per_step=model.flops_per_token(seq) * tokens,
        hardware_flops_per_step=hardware_flops_per_token(model, layout.recompute, seq,
                                                         recompute_fraction(model, layout)) * tokens,
        tokens_per_step=tokens, host_bytes=host, stage_totals=[n for n, _ in per_stage])


def estimate_model_states(num_params: int, layout: Layout, convention: str = "zero-paper") -> Estimate:
    """Model-state-only estimate from a raw parameter count (no activations, no model shape).

    Parameters are split evenly over tp * pp. With the ZeRO paper's accounting (the default;
    see `model_state_bytes`) it reproduces the paper's Figure 1 example: 7.5e9 params,
    Layout(dp=64, precision="fp16", grad_reduce_dtype="fp16", zero_stage=0..3).
    """
    _check_choices(layout)
    params = math.ceil(num_params / (layout.tp * layout.pp))
    weights, grads, optimizer, host = model_state_bytes(params, layout, convention)
    comm: dict[str, int] = {}
    add_dp_bytes(lambda key, n: comm.__setitem__(key, comm.get(key, 0) + n) if n else None, params, layout)
    tokens = layout.global_batch() * (layout.seq_length or 0)
    return Estimate(param_bytes=weights, grad_bytes=grads, optimizer_state_bytes=optimizer, activation_bytes=0,
                    params_per_rank=params, stage=0, layers_on_stage=0, inflight_microbatches=0,
                    num_microbatches=layout.microbatches(), bubble_fraction=0.0, comm_bytes=comm,
                    flops_per_step=6.0 * num_params * tokens, hardware_flops_per_step=6.0 * num_params * tokens,
                    tokens_per_step=tokens, host_bytes=host, stage_totals=[weights + grads + optimizer])
