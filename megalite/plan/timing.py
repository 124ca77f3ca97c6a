"""Predicted seconds per optimizer step, by part, on a hardware profile (pure arithmetic, no torch).

One microbatch through one transformer block on one tensor-parallel rank costs
  GEMMs            each at the profile's efficiency for its size (megalite/plan/hardware.py):
                   QKV, output projection, MLP in and out, and attention's two batched products
                   (a fused flash kernel: from the profile's measured table where it has the call,
                   kernel_rates.py, else at its attention efficiency);
                   backward runs two GEMMs of the same size per forward GEMM (input and weight
                   gradients); flash attention's backward five products (it recomputes the scores);
  memory-bound ops the bytes the norms, bias-dropout-adds and rotary embedding read and write, at
                   the copy bandwidth, and those of the ops with transcendental math (the MLP's
                   activation; softmax and dropout of attention that writes its scores; cross
                   entropy's exp; AdamW) at the profile's elementwise rate (a CPU's vector math is
                   slower than its memory); backward moves 1.5x the forward's bytes (it reads the saved input
                   and the output gradient and writes the input gradient; RoPE's backward reads only
                   the gradient, SwiGLU's writes two); each linear's weight gradient is added into an
                   fp32 main-gradient buffer; where the profile measured them (kernel_rates.py), each
                   kernel family at its measured fraction of the copy bandwidth, and megalite's own
                   layout copies (attention's output and its gradient, SwiGLU's halves, bias adds,
                   the QKV gradients' copies and concatenation) at torch's copy kernels' rate;
  host time        the profile's block overhead (launches, dispatch): added to the above on a CPU,
                   overlapped with it on a GPU; where the profile measured the host time per GPU
                   operation, the operations counted from the model (launches.py) at that time,
                   queued against the GPU's forward and backward (launches.queued_seconds), one
                   graph replay per microbatch with --cuda-graph;
  recompute        selective: attention's forward again; full: the block's forward again.
The first stage adds the embedding, the last the final norm, output layer and cross entropy, each
microbatch. Tensor-parallel and pipeline transfers are exposed (megalite overlaps neither), from
the planner's per-stage byte counts (communication.py) at the bus bandwidth of the link the group
spans. A stage is busy m x its per-microbatch time plus its transfers; the slowest stage sets the
pace, and the schedule's bubble (`bubble_fraction`) idles every stage for the average stage's
share (on a CPU at the contention of half the ranks: idle ranks free their cores). The
data-parallel reduction overlaps the last microbatch's backward (what exceeds it is exposed; on
a CPU it adds: gloo's reduction runs on the cores that compute); the ZeRO parameter all-gather is
exposed unless --overlap-param-gather hides it behind the next forward; ZeRO-3 gathers and
reductions overlap the whole step's compute, except the gather of the first unit of every forward
and backward pass (nothing precedes it); with PowerSGD the reduction (the compressed bytes of
communication.py, two all-reduces) and its arithmetic (three thin GEMMs and fp32 passes per
compressed gradient) follow the whole backward. The optimizer
streams its shard's fp32 state through memory once (with measured rates: each pass its code makes). On a CPU, ranks computing at once slow each
other down (the profile's measured `rank_slowdown`, or ranks x threads over the cores), and its
transfers, being the cores' work too, slow down with them. Every step also waits for a few
one-element all-reduces (token count, loss, finiteness, gradient norm) at their groups' fixed cost:
microseconds on a GPU, milliseconds where ranks outnumber a CPU's cores (the profile's
`collective_ranks`, measured per group size). FP8's amax all-reduces (plan/fp8_amax.py: several
per linear and microbatch) each pay their group's fixed cost too, exposed with the tp (or cp) time.

`Kernels` says what the modelled software runs where that changes time: megalite (flash attention,
plain p2p) or, to check the model against Narayanan et al. 2021's measured iterations, Megatron-LM
of that paper (`MEGATRON_2021`: attention that writes its [b, heads, s, s] scores, the
scatter/gather pipeline transfer, the QKV bias and context layout passes, cross entropy over fp32
logits, and the "local" DDP's all-reduce after the backward).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from megalite.config.choices import OptimizerKind, Precision, Recompute
from megalite.config.model import GPTConfig
from megalite.plan.muon import ns_seconds
from megalite.plan.muon_stage import stage_muon
from megalite.plan import fp8, kernel_rates as rates
from megalite.plan.activations import output_kept_once
from megalite.plan.comm_time import stage_communication, step_tokens
from megalite.plan.communication import step_scalar_collectives
from megalite.plan.compression import compression_enabled
from megalite.plan.hardware import HardwareProfile, load_profile
from megalite.plan.launches import (block_launches, host_seconds, optimizer_launches, queued_seconds, stage_launches,
                                    uses_cuda_graph)
from megalite.plan.layout import DTYPE_BYTES, head_stage, recomputed_stage_layers, stage_layers, zero_shard_ranks
from megalite.plan.params import layer_params, stage_params
from megalite.plan.per_rank import bubble_fraction

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class Kernels:
    """What the modelled software does where it changes the time."""

    attention: str = "flash"
    """"flash": scores never leave the kernel, causal blocks above the diagonal skipped;
    "materialized": scores [b, heads, s, s] written, then read and written by softmax and dropout."""
    p2p_scatter_gather: bool = False
    """Each tp rank sends 1/tp of a pipeline activation, the receiver all-gathers it over tp."""
    grad_reduce_overlap: bool = True
    """The data-parallel gradient reduction starts during the last microbatch's backward (megalite's
    buckets; torch DDP) rather than after the whole backward (Megatron-LM 2021's "local" DDP)."""
    layout_copies: bool = False
    """Two extra passes per block: the QKV bias added by its own kernel (torch's F.linear on a 3-D
    input: matmul, then add) and attention's context made contiguous, [b, heads, s, d] -> [s, b, h]."""
    fp32_cross_entropy: bool = False
    """Cross entropy over fp32 logits in unfused passes (upcast, max, subtract, exp, sum, divide;
    backward: scale, downcast) rather than one fused pass over the logits in the parameter dtype."""
    reentrant_recompute: bool = False
    """Full recompute re-runs each block's whole forward, so the MLP output's tensor-parallel reduction
    runs again too (Megatron-LM's own reentrant checkpoint function); megalite's non-reentrant
    checkpoint stops after the last saved tensor, before that reduction."""
    attention_backend: str = "auto"
    """Which flash attention runs where the profile measured them (kernel_rates.py): "auto" (megalite's
    dispatch: the fastest measured), or "triton" / "sdpa" / "sdpa_gqa" forced, as MEGALITE_KERNEL_BACKEND."""


MEGALITE = Kernels()
MEGATRON_2021 = Kernels(attention="materialized", p2p_scatter_gather=True, grad_reduce_overlap=False,
                        layout_copies=True, fp32_cross_entropy=True, reentrant_recompute=True)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by part; `total` is their sum."""

    compute: float
    """The slowest pipeline stage's busy time without communication (GEMMs, memory-bound ops, host)."""
    tp: float
    cp: float
    pp: float
    dp: float
    """Exposed communication of each group (dp includes the tied embedding's all-reduce)."""
    bubble: float
    """Pipeline idle time of the schedule (the average stage's share of fill and drain)."""
    optimizer: float
    """The update (memory traffic of the fp32 state) and per-step host overhead."""
    sync: float = 0.0
    """The step's one-element all-reduces every rank waits for (token count, loss finiteness, mean
    loss, gradient norm: communication.step_scalar_collectives), each at its group's fixed cost."""
    offload: float = 0.0
    """With --offload-optimizer: PCIe transfers and the CPU update."""

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def breakdown(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class _Pass:
    """Device seconds of forward and backward of one microbatch through something, and its attention part."""

    forward: float
    backward: float
    attention_forward: float = 0.0


def block_pass(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile, kernels: Kernels = MEGALITE) -> _Pass:
    """Device seconds of one block, one microbatch, one tp rank: forward and backward (no recompute)."""
    a = DTYPE_BYTES[cfg.precision.precision]
    t, b = cfg.parallel.tp, cfg.training.micro_batch_size
    sp = t if cfg.parallel.sequence_parallel else 1
    tokens, local = step_tokens(model, cfg)
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    nq, nkv = model.num_attention_heads // t, model.num_query_groups // t
    llama = model.flavour == "llama"
    linears = [(tokens, (nq + 2 * nkv) * d, h), (tokens, h, nq * d), (tokens, (2 if llama else 1) * f // t, h),
               (tokens, h, f // t)]
    gemm = sum(hw.matmul_seconds(m, n, k, fp8.gemm_precision(cfg, hw.peak_tflops)) for m, n, k in linears)
    casts = fp8.cast_bytes(linears, a) if fp8.enabled(cfg) else (0, 0)  # --fp8-format: the casts' memory passes
    scores, values = rates.attention_products(model, cfg, hw, kernels.attention, kernels.attention_backend, b * nq,
                                              local)
    attention = scores + values
    streamed = 2 * (3 * a * tokens * h // sp)                        # two bias-dropout-adds: x, residual -> out
    if kernels.layout_copies:                                        # QKV bias: read, write; context copy
        streamed += 2 * a * tokens * (nq + 2 * nkv) * d + 2 * a * tokens * nq * d
    if kernels.attention == "materialized":                          # softmax (read, write); dropout + 1-byte mask
        per_score = 2 * a + (2 * a + 1 if model.attention_dropout > 0 else 0)
        attention += hw.elementwise_seconds(per_score * b * nq * local * model.seq_length)
    norms = rates.memory_seconds(hw, "rms_norm" if llama else "layer_norm", 2 * (2 * a * tokens * h // sp),
                                 2 * (3 * a * tokens * h // sp))     # two norms: x -> y; x, dy -> dx
    rope = rates.memory_seconds(hw, "rope", 2 * a * tokens * (nq + nkv) * d, 2 * a * tokens * (nq + nkv) * d) \
        if llama else (0.0, 0.0)                                     # q and k: x -> y; dy -> dx
    act = a * tokens * f // t                                        # swiglu: gate, up -> y; gelu: x -> y
    mlp = rates.memory_seconds(hw, "swiglu", 3 * act, 5 * act, True) if llama else \
        rates.memory_seconds(hw, "gelu", 2 * act, 3 * act, True)
    megalite_layout = kernels.attention == "flash" and not kernels.layout_copies
    in_place = output_kept_once(cfg, rates.attention_implementation(model, cfg, hw, kernels.attention_backend))
    layout = rates.layout_copies(model, cfg, hw, tokens, megalite_layout, in_place)
    forward = gemm + attention + hw.memory_seconds(streamed + casts[0]) + norms[0] + rope[0] + mlp[0] + layout[0]
    bias_grads = a * tokens * sum(n for _, n, _ in linears) if model.add_bias else 0
    products = scores + values
    backward = 2 * gemm + (2.5 if kernels.attention == "flash" else 2.0) * products + 1.5 * (attention - products)
    backward += hw.memory_seconds(1.5 * streamed + bias_grads + casts[1]) + norms[1] + rope[1] + mlp[1] + layout[1]
    if "grad_accumulate" in hw.memory_fractions:                     # fp32 main grad += grad: read 4 + a, write 4
        backward += rates.memory_seconds(hw, "grad_accumulate", (8 + a) * layer_params(model, t))[0]
    else:                                                            # read-add-write into fp32 main grads
        backward += hw.memory_seconds(8 * layer_params(model, t))
    return _Pass(forward, backward, attention)


def embedding_pass(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile) -> _Pass:
    """The first stage's embedding: rows gathered (+ positions, dropout); backward adds into fp32 grads."""
    a = DTYPE_BYTES[cfg.precision.precision]
    tokens, _ = step_tokens(model, cfg)
    h = model.hidden_size
    return _Pass(hw.memory_seconds(4 * a * tokens * h), hw.memory_seconds((a + 8) * tokens * h))


def head_pass(model: GPTConfig, cfg: RunConfig, hw: HardwareProfile, kernels: Kernels = MEGALITE) -> _Pass:
    """The last stage's final norm, output layer [tokens, h] x [h, V/tp] and cross entropy over the logits."""
    precision, a = cfg.precision.precision, DTYPE_BYTES[cfg.precision.precision]
    t = cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    tokens, _ = step_tokens(model, cfg)
    h, vocab = model.hidden_size, model.padded_vocab_size(t) // t
    gemm = hw.matmul_seconds(tokens, vocab, h, precision)
    logits = a * tokens * vocab
    fused = 1 if cfg.parallel.fused_linear_cross_entropy else 0     # recomputes the logits in backward
    forward_passes, backward_passes = 2 * logits, 2 * logits         # read the logits, write the gradient
    if kernels.fp32_cross_entropy:  # bytes per logit: upcast 2+4, max 4, sub 8, exp 8, sum 4, div 8 | scale 8, downcast 6
        forward_passes, backward_passes = (6 + 4 + 8 + 8 + 4 + 8) * logits // a, (8 + 6) * logits // a
    family = "fp32_cross_entropy" if kernels.fp32_cross_entropy else "cross_entropy"
    loss = rates.memory_seconds(hw, family, forward_passes, backward_passes, True)                 # exp
    norm = rates.memory_seconds(hw, "rms_norm" if model.flavour == "llama" else "layer_norm",
                                2 * a * tokens * h // sp, 3 * a * tokens * h // sp)
    forward = gemm + norm[0] + loss[0]
    backward = (2 + fused) * gemm + norm[1] + loss[1]
    return _Pass(forward, backward)


def stage_compute(model, cfg, hw, kernels, stage: int, block: _Pass | None = None) -> tuple[
        float, tuple[float, float], float, float]:
    """(device seconds, host seconds (forward, backward), backward device seconds, attention forward
    seconds) of one stage over all its chunks, per microbatch, from `block` (block_pass, the same on
    every stage: a caller predicting every stage passes it once; None computes it). Host: the
    launches counted from the model at the profile's `launch_host_us` (one graph replay per
    microbatch with CUDA graphs), else the per-block and per-microbatch overheads (all of it in the
    backward's slot)."""
    block = block or block_pass(model, cfg, hw, kernels)
    layers = stage_layers(model, cfg)[stage]
    rerun = recomputed_stage_layers(model, cfg)[stage]
    device = layers * (block.forward + block.backward)
    backward = layers * block.backward
    if cfg.parallel.recompute == Recompute.SELECTIVE:
        device += layers * block.attention_forward
        backward += layers * block.attention_forward
    device += rerun * block.forward
    backward += rerun * block.forward
    host = (layers + 0.5 * rerun) * hw.block_overhead_us * 1e-6    # a forward is about half a block's launches
    for present, part in ((stage == 0, embedding_pass), (stage == head_stage(cfg), head_pass)):
        if present:
            p = part(model, cfg, hw, kernels) if part is head_pass else part(model, cfg, hw)
            device, backward = device + p.forward + p.backward, backward + p.backward
    host += hw.microbatch_overhead_us * 1e-6 * (1.0 if cfg.parallel.pp == 1 else 0.5)  # ends split over stages
    if not hw.launch_host_us:
        return device, (0.0, host), backward, layers * block.attention_forward
    attention = rates.attention_implementation(model, cfg, hw, kernels.attention_backend)
    in_place = output_kept_once(cfg, attention)
    counted = stage_launches(model, cfg, stage, attention)
    selective = (3 if in_place else 4) * layers if cfg.parallel.recompute == Recompute.SELECTIVE else 0  # RoPE q, k;
    rerun_launches = rerun * block_launches(model, in_place).forward + selective     # attention; its copy
    host_passes = (1, 0) if uses_cuda_graph(cfg) else (counted.forward, counted.backward + rerun_launches)
    return device, tuple(host_seconds(hw, n) for n in host_passes), backward, layers * block.attention_forward


def _optimizer_seconds(model, cfg, hw, params: int, stage: int) -> tuple[float, float]:
    """(update seconds, offload seconds): AdamW streams the fp32 master, moments and gradient of its
    shard (read 16, write 12 bytes), the norm reads the gradient, the update is published in the
    parameter dtype, and the full fp32 gradient buffer is zeroed. Where the profile measured AdamW's
    rate, the passes megalite's optimizer makes are counted as its code runs them
    (distributed_optimizer.py, bytes per element of the shard): the norm's square and sum (read 8,
    write 4), the clip multiply (8; with clip_grad > 0 it runs whenever the norm exceeds it, as in
    every measured step), the weight decay of the masters (8; counted for every parameter), AdamW at
    its measured rate, the publish (4 + a); and the host's launches (launches.py) overlap that GPU
    time after the norm's sync, or else the step overhead adds."""
    a = DTYPE_BYTES[cfg.precision.precision]
    shard = params / zero_shard_ranks(cfg) if cfg.parallel.zero else params
    offload = 0.0
    measured = "adamw" in hw.memory_fractions
    if cfg.parallel.offload_optimizer:  # grads down, params up over PCIe (~25 GB/s), CPU Adam (~1e9 params/s)
        offload, update = shard * 6 / 25e9 + shard / 1e9, 0.0
    elif measured:
        clip = 8 if cfg.optimizer.clip_grad > 0 or cfg.precision.precision == Precision.FP16 else 0
        decay = 8 if cfg.optimizer.weight_decay != 0 else 0
        update = rates.memory_seconds(hw, "adamw", 28 * shard, transcendental=True)[0]
        update += hw.memory_seconds(shard * (12 + clip + decay + 4 + a))
    else:
        update = hw.elementwise_seconds(shard * (28 + 4 + a))
    gpu = update + hw.memory_seconds(4 * params)
    if cfg.optimizer.optimizer == OptimizerKind.MUON:  # the busiest owner's Newton-Schulz GEMMs (plan/muon_stage.py)
        gpu += ns_seconds(hw, stage_muon(model, cfg, stage).ns_flops_busiest, cfg.optimizer.muon_ns_dtype)
    if not hw.launch_host_us:
        return gpu + hw.step_overhead_us * 1e-6, offload
    return max(gpu, host_seconds(hw, optimizer_launches(model, cfg, stage))), offload


def _stage_time(model, cfg, hw, kernels, per_node: int, stage: int, block: _Pass) -> tuple[float, dict, float, float]:
    """(busy seconds of the step: m microbatches, its communication seconds by part, backward and
    forward seconds of one microbatch) of one stage, at the slowdown of `per_node` ranks on a node."""
    slowdown = hw.compute_slowdown(per_node)
    device, host, backward, attention = stage_compute(model, cfg, hw, kernels, stage, block)
    if hw.host_synchronous:
        busy = (device + sum(host)) * slowdown
    elif hw.launch_host_us:   # the host queues work ahead of the GPU; neither pass syncs
        busy = queued_seconds([(host[0], device - backward), (host[1], backward)]) * slowdown
    else:
        busy = max(device, sum(host)) * slowdown
    comm = stage_communication(model, cfg, hw, kernels, per_node, stage, attention * slowdown)
    if hw.host_synchronous:  # a CPU's collectives are work of its cores too
        comm = {key: seconds * slowdown for key, seconds in comm.items()}
    return cfg.num_microbatches * busy, comm, backward * slowdown, (device - backward) * slowdown


def step_time_lower_bound(model: GPTConfig, cfg: RunConfig, hardware: str | HardwareProfile | None = None,
                          ranks_per_node: int | None = None, kernels: Kernels = MEGALITE) -> float:
    """A number predict_step_time's total is never below, at about 1/pp of its cost: the last
    stage's exposed time (m x its busy time + its tp, cp and pp seconds). The total is the slowest
    stage's exposed time plus parts that are each >= 0 (dp, bubble, optimizer, sync, offload), and
    the slowest stage's is at least the last stage's."""
    hw = load_profile(hardware)
    per_node = min(cfg.world_size, ranks_per_node or hw.devices_per_node or cfg.world_size)
    busy, comm, _, _ = _stage_time(model, cfg, hw, kernels, per_node, head_stage(cfg),
                                   block_pass(model, cfg, hw, kernels))
    return busy + comm["tp"] + comm["cp"] + comm["pp"]


def predict_step_time(model: GPTConfig, cfg: RunConfig, hardware: str | HardwareProfile | None = None,
                      ranks_per_node: int | None = None, kernels: Kernels = MEGALITE) -> StepTime:
    """Seconds per optimizer step of `cfg` on `hardware` (a profile, a built-in name or a profile file).

    ranks_per_node: ranks one node holds (default the profile's devices_per_node; a CPU profile
    puts every rank on one node). See the module docstring for the model.
    """
    hw = load_profile(hardware)
    world, pp = cfg.world_size, cfg.parallel.pp
    per_node = min(world, ranks_per_node or hw.devices_per_node or world)
    slowdown = hw.compute_slowdown(per_node)
    block = block_pass(model, cfg, hw, kernels)
    stages = [_stage_time(model, cfg, hw, kernels, per_node, stage, block) for stage in range(pp)]
    exposed = [busy + c["tp"] + c["cp"] + c["pp"] for busy, c, _, _ in stages]
    slowest = max(range(pp), key=lambda s: exposed[s])
    busy, comm, backward, forward = stages[slowest]
    fraction = bubble_fraction(cfg)
    # while the pipeline fills and drains about half the stages compute: a CPU's idle ranks free cores
    filling = hw.compute_slowdown(max(1, per_node // 2)) / slowdown if pp > 1 else 1.0
    bubble = sum(exposed) / pp * fraction / (1.0 - fraction) * filling
    # a GPU reduces while it computes; a CPU's reduction is its cores' work, so nothing hides it;
    # PowerSGD compresses and reduces after the whole backward
    hidden = 0.0 if hw.host_synchronous else 1.0
    window = hidden if kernels.grad_reduce_overlap and not compression_enabled(model, cfg) else 0.0
    dp = max(c["dp_reduce"] - window * w for _, c, w, _ in stages)   # behind the last microbatch's backward
    if cfg.parallel.zero >= 3:  # prefetched behind forward and backward, but for each pass's first unit
        dp = max(max(0.0, c["dp_reduce"] + c["dp_gather"] - hidden * b) + hidden * c["dp_first_unit"]
                 for b, c, _, _ in stages)
    elif getattr(cfg.parallel, "overlap_param_gather", False):
        dp = max(0.0, dp) + max(max(0.0, c["dp_gather"] - f) for _, c, _, f in stages)
    else:
        dp = max(0.0, dp) + max(c["dp_gather"] for _, c, _, _ in stages)
    dp += max(c["embedding"] for _, c, _, _ in stages)
    # hybrid sharding: the replicas' all-reduce starts as the step's reduction is waited for: exposed
    dp += max(c["dp_replicate"] for _, c, _, _ in stages)
    biggest = max(range(pp), key=lambda s: stage_params(model, cfg, s))
    update, offload = _optimizer_seconds(model, cfg, hw, stage_params(model, cfg, biggest), biggest)
    sync = sum(count * hw.collective_latency_s(ranks) for ranks, count in step_scalar_collectives(cfg).values())
    return StepTime(compute=busy, tp=comm["tp"], cp=comm["cp"], pp=comm["pp"], dp=dp, bubble=bubble,
                    optimizer=update * slowdown, offload=offload,
                    sync=sync * (slowdown if hw.host_synchronous else 1.0))
