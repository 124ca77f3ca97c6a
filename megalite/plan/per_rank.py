"""Know before you launch: per-rank memory, communication, FLOPs and bubble of a layout.

Pure arithmetic on a `GPTConfig` and a `RunConfig`; no torch, no process group. Used by
`tools/plan.py`, by `pretrain_gpt --dry-run`, by `validity.py` (configuration errors before
any process group exists) and `ranking.py` (the step-time model, layout suggestions).

Units: everything is in bytes (and FLOPs). Human-readable output uses GB = 1e9 bytes, the
convention of the ZeRO paper (Rajbhandari et al. 2020), whose worked example this module
reproduces: 7.5B parameters, Nd = 64, fp16 params and grads, Adam with K = 12 bytes/param of
optimizer state -> 120 / 31.4 / 16.6 / 1.9 GB per GPU for ZeRO stage 0 / 1 / 2 / 3.

Model states per parameter held by a rank, as megalite's DP engine and distributed optimizer
keep them (see `model_state_bytes`; --num-params uses the ZeRO paper's accounting instead):
  params  2 (bf16/fp16) or 4 (fp32); ZeRO-3: 4/dp (an fp32 shard in every precision, cast to
          the training dtype as it is gathered), plus the units gathered at the peak (zero3.py)
  grads   4 (fp32 main grads) + 4/dp (the reduced shard, ZeRO >= 1); ZeRO-3: 4/dp + two units;
          with --grad-compression powersgd also 4 per compressed element (the residual share)
          and Q (compression.py)
  optim   8 (Adam m, v: fp32 parameters, and ZeRO-3's shard, are the master) or 12 (+ fp32
          master for bf16/fp16 below ZeRO-3, or when offloaded), /dp with ZeRO >= 1; in host
          memory when offloaded
  So ZeRO-3 holds 16 bytes per parameter per dp rank (4 + 4 + 8) in fp32 and in bf16.
Under context parallelism parameters are replicated over dp x cp and ZeRO shards over it:
"dp" above is then dp*cp.

Activations: what megalite's own blocks keep for backward per microbatch, counted storage by
storage in the manner of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"; see `layer_activation_bytes`) and checked against the real model on CPU
(tests/training/test_estimate.py), times the microbatches in flight on the stage (1F1B:
pp - stage; interleaved: Megatron's warmup + 1 chunks; GPipe: all; ZB-H1: counted on the
schedule). The estimate is for the worst stage. Transient buffers: one block's working tensors
live at the peak (`buffer_bytes`, plan/buffers.py, measured by --simulate); the rest (NCCL's own
buffers, allocator fragmentation) is left to `Estimate.fits`' headroom.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from megalite.config.choices import OptimizerKind, Precision, Schedule
from megalite.config.model import GPTConfig
from megalite.plan.muon_ranks import muon_rank_terms
from megalite.plan.muon_shards import muon_state_saved
from megalite.plan.activations import activation_bytes, inflight_microbatches
from megalite.plan.buffers import buffer_bytes, model_buffer_bytes
from megalite.plan.communication import add_dp_bytes, communication_bytes
from megalite.plan.diloco import outer_state_bytes
from megalite.plan.compression import compression_state_bytes
from megalite.plan.layout import DTYPE_BYTES, GB, is_v_shaped, recompute_fraction, stage_layers, zero_shard_ranks
from megalite.plan.moe import expert_dp_config, stage_expert_params
from megalite.plan.params import hardware_flops_per_token, mean_document_length, stage_params
from megalite.plan.zero3 import gathered_peak_elements, transient_grad_bytes

if TYPE_CHECKING:
    from megalite.config import RunConfig


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
    hardware_flops_per_rank: float = 0.0
    """Executed FLOPs of one rank per step: the job's / (tp*cp*pp*dp) (cp ranks split every sequence)."""
    host_bytes: int = 0
    """Bytes kept in host memory per rank (offloaded optimizer state)."""
    stage_totals: list[int] = field(default_factory=list)
    """total_bytes of every pipeline stage (the estimate reports the largest)."""
    buffer_bytes: int = 0
    """Transient tensors live at the peak beside the other four terms (plan/buffers.py)."""
    setup_bytes: int = 0
    """The data-parallel wrapper's set-up (`setup_bytes`): a peak before the first step."""
    optimizer_step_bytes: int = 0
    """The optimizer step's working set beside the model states, the activations freed: Muon's whole
    matrices on the busiest owner (plan/muon_ranks.py); 0 under AdamW."""

    @property
    def step_bytes(self) -> int:
        """The step's peak: the model states beside the larger of (activations + buffers) and the
        optimizer step's working set."""
        return (self.param_bytes + self.grad_bytes + self.optimizer_state_bytes
                + max(self.activation_bytes + self.buffer_bytes, self.optimizer_step_bytes))

    @property
    def total_bytes(self) -> int:
        """The rank's peak: the step's, or the set-up's where that is larger (ZeRO 1 over many dp ranks)."""
        return max(self.step_bytes, self.setup_bytes)

    def fits(self, gpu_memory: float, headroom: float = 0.1) -> bool:
        """True when total_bytes fits in (1 - headroom) of gpu_memory bytes (the rest: CUDA
        context, NCCL buffers, allocator fragmentation, transient tensors)."""
        return fits_memory(self.total_bytes, gpu_memory, headroom)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total_bytes"] = self.total_bytes
        return out

    def describe(self, gpu_memory: float | None = None) -> str:
        """A readable per-rank table in GB (1e9 bytes)."""
        rows = [("parameters", self.param_bytes), ("gradients", self.grad_bytes),
                ("optimizer state", self.optimizer_state_bytes), ("activations", self.activation_bytes),
                ("buffers", self.buffer_bytes)]
        if self.setup_bytes > self.step_bytes:  # the set-up's peak is the rank's
            rows += [("step peak", self.step_bytes), ("set-up peak", self.setup_bytes)]
        rows.append(("total", self.total_bytes))
        lines = [f"per rank (pipeline stage {self.stage}, {self.layers_on_stage} layers, "
                 f"{self.inflight_microbatches} of {self.num_microbatches} microbatches in flight):"]
        lines += [f"  {name:<16} {n / GB:10.3f} GB" for name, n in rows]
        if self.host_bytes:
            lines.append(f"  {'host (offload)':<16} {self.host_bytes / GB:10.3f} GB")
        if gpu_memory:
            verdict = "fits" if self.fits(gpu_memory) else "does NOT fit"
            lines.append(f"  {verdict} in {gpu_memory / GB:.1f} GB (keeping 10% headroom)")
        lines.append(f"pipeline bubble: {100 * self.bubble_fraction:.1f}% of the step")
        lines.append(f"FLOPs per step: {self.flops_per_step:.3e} model, {self.hardware_flops_per_step:.3e} executed"
                     f" ({self.hardware_flops_per_rank:.3e} per rank)")
        for key, n in sorted(self.comm_bytes.items()):
            lines.append(f"  comm {key:<24} {n / GB:10.4f} GB/step")
        return "\n".join(lines)


def fits_memory(total_bytes: int, gpu_memory: float, headroom: float = 0.1) -> bool:
    """The fit rule: `total_bytes` within (1 - headroom) of `gpu_memory` bytes."""
    return total_bytes <= (1.0 - headroom) * gpu_memory


def model_state_bytes(params: int, cfg: RunConfig, convention: str = "megalite") -> tuple[int, int, int, int]:
    """(param, grad, optimizer-on-GPU, host) peak bytes for `params` parameters on one rank.

    "megalite" (megalite.optim.distributed_optimizer's table): Adam moments (8 bytes) plus an
    fp32 master (4) unless the parameters themselves are fp32 on the device, /dp with ZeRO >= 1;
    fp32 main grads (4 bytes whatever grad_reduce_dtype, which only sets the reduction's wire
    dtype) plus, with ZeRO >= 1, the reduced fp32 shard (4/dp). ZeRO-2 frees a bucket's full
    gradient only once its reduction (started during the last microbatch's backward) completes,
    so the full buffer still exists at the end of the backward: its peak is ZeRO-1's (it saves
    memory between steps, e.g. for the next forward, which this per-rank peak does not credit).
    ZeRO-3: shard-sized parameters and gradients; the gathered units and transient unit
    gradients are added by `estimate` (they need the model's shape, plan/zero3.py).
    "zero-paper" (Rajbhandari et al. 2020): grads in grad_reduce_dtype, K = 12 (mixed) or 8
    (fp32) optimizer bytes, ZeRO-1/2/3 partition optimizer / + grads / + params over dp.
    """
    p = DTYPE_BYTES[cfg.precision.precision]
    z, shard = cfg.parallel.zero, math.ceil(params / zero_shard_ranks(cfg))  # dp x cp, or S x cp (hybrid)
    if convention == "zero-paper":
        g = DTYPE_BYTES[cfg.precision.grad_reduce_dtype]
        optimizer = (shard if z >= 1 else params) * (8 if cfg.precision.precision == Precision.FP32 else 12)
        grads = (shard if z >= 2 else params) * g
    else:
        # fp32 parameters (ZeRO-3: the fp32 shard, in every precision) are the master, unless offloaded
        own_master = (cfg.precision.precision == Precision.FP32 or z == 3) and not cfg.parallel.offload_optimizer
        optimizer = (shard if z >= 1 else params) * (8 if own_master else 12)
        grads = 4 * shard if z == 3 else 4 * params + (4 * shard if z >= 1 else 0)
        if z == 3:
            return 4 * shard, grads, *((0, optimizer) if cfg.parallel.offload_optimizer else (optimizer, 0))
    weights = (shard if z >= 3 else params) * p
    if cfg.parallel.offload_optimizer:
        return weights, grads, 0, optimizer
    return weights, grads, optimizer, 0


def check_degrees(cfg: RunConfig, model: GPTConfig | None = None) -> None:
    """Raise ValueError when the layout breaks a rule (megalite.layout: the same line the configuration
    check and init_mesh give; `model`: whose experts, default the configuration's) or the micro batch is not a positive
    integer (choices are checked where the RunConfig is built)."""
    cfg.layout(model=model)
    if not isinstance(cfg.training.micro_batch_size, int) or cfg.training.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be a positive integer, got {cfg.training.micro_batch_size!r}")


def bubble_fraction(cfg: RunConfig) -> float:
    """Idle fraction of a step: (p-1)/(v*m + p-1) for 1F1B/interleaved/GPipe, (p-1)/(3m + p-1)
    for ZB-H1 (its F, B and W passes each fill a third of a 1F1B slot), (p-1)/(6m + p-1) for
    DualPipeV as megalite runs it (each rank idles one chunk's F per stage after the first:
    docs/architecture/pipeline.md)."""
    p, m = cfg.parallel.pp, cfg.num_microbatches
    slots = 6 * m if is_v_shaped(cfg) else 3 * m if cfg.schedule == Schedule.ZB_H1 else cfg.parallel.virtual_stages * m
    return (p - 1) / (slots + p - 1)


def estimate(model: GPTConfig, cfg: RunConfig, attention: str | None = None) -> Estimate:
    """Per-rank memory, communication, bubble and FLOPs for the worst pipeline stage; `attention`:
    the implementation the blocks' attention runs, where the caller knows it (activations.py)."""
    check_degrees(cfg, model)
    seq = model.seq_length
    per_stage = [(stage_total_bytes(model, cfg, stage, attention), stage) for stage in range(cfg.parallel.pp)]
    _, worst = max(per_stage)
    params = stage_params(model, cfg, worst)
    weights, grads, optimizer, host = stage_model_states(model, cfg, worst)
    m = cfg.num_microbatches
    tokens = cfg.global_batch_size * seq
    documents = mean_document_length(cfg)
    hardware_flops = hardware_flops_per_token(model, cfg.parallel.recompute, seq, recompute_fraction(model, cfg),
                                              documents) * tokens
    return Estimate(
        param_bytes=weights, grad_bytes=grads, optimizer_state_bytes=optimizer,
        activation_bytes=activation_bytes(model, cfg, worst, attention), params_per_rank=params, stage=worst,
        layers_on_stage=stage_layers(model, cfg)[worst],
        inflight_microbatches=inflight_microbatches(cfg, worst), num_microbatches=m,
        bubble_fraction=bubble_fraction(cfg),
        comm_bytes=communication_bytes(model, cfg, worst),
        flops_per_step=model.flops_per_token(seq, documents) * tokens,
        hardware_flops_per_step=hardware_flops, hardware_flops_per_rank=hardware_flops / cfg.world_size,
        tokens_per_step=tokens, host_bytes=host, stage_totals=[n for n, _ in per_stage],
        buffer_bytes=buffer_bytes(model, cfg, worst, attention), setup_bytes=setup_bytes(model, cfg, weights, grads),
        optimizer_step_bytes=muon_rank_terms(model, cfg, worst)[1])


def stage_total_bytes(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None) -> int:
    """Device bytes of one rank of `stage` at its peak: model states, saved activations and transient
    buffers, or the set-up's where larger (the estimate's total_bytes is the largest of these over the stages)."""
    weights, grads, optimizer, _ = stage_model_states(model, cfg, stage)
    working = activation_bytes(model, cfg, stage, attention) + buffer_bytes(model, cfg, stage, attention)
    step = weights + grads + optimizer + max(working, muon_rank_terms(model, cfg, stage)[1])
    return max(step, setup_bytes(model, cfg, weights, grads))


def setup_bytes(model: GPTConfig, cfg: RunConfig, weights: int, grads: int) -> int:
    """The data-parallel wrapper's set-up peak at ZeRO 0 and 1: it allocates the fp32 gradient storage
    (`grads`), then one contiguous parameter buffer into which it copies the module's own parameters,
    so both copies of the parameters live beside the gradients: 2 * weights + grads (measured by
    --simulate: llama-405b's last stage at ZeRO 1, dp 128, where the optimizer's shard is small).
    ZeRO 2 then holds the gradient shard only and ZeRO 3 shards as it builds: never the peak (0). The
    model's buffers (RoPE tables, plan/buffers.model_buffer_bytes) are there too."""
    return 2 * weights + grads + model_buffer_bytes(model, cfg) if cfg.parallel.zero < 2 else 0


def stage_model_states(model: GPTConfig, cfg: RunConfig, stage: int, *,
                       rank: int | None = None) -> tuple[int, int, int, int]:
    """`model_state_bytes` of a stage's parameters, with ZeRO-3's gathered units and transient
    unit gradients (and only then: dp = 1 shards nothing, but the units are still gathered), and
    gradient compression's state. With Muon the state is global `rank`'s own (its shard's Muon
    elements: plan/muon_shards.py; None: the stage's first rank's)."""
    experts = stage_expert_params(model, cfg, stage)  # sharded by ZeRO over expert-dp, not dp x cp
    weights, grads, optimizer, host = model_state_bytes(stage_params(model, cfg, stage) - experts, cfg)
    if experts:
        for i, n in enumerate(model_state_bytes(experts, expert_dp_config(cfg))):
            weights, grads, optimizer, host = [x + (n if j == i else 0) for j, x in
                                               enumerate((weights, grads, optimizer, host))]
    if cfg.parallel.zero == 3:
        weights += gathered_peak_elements(model, cfg, stage) * DTYPE_BYTES[cfg.precision.precision]
        grads += transient_grad_bytes(model, cfg, stage)
    grads += compression_state_bytes(model, cfg, stage)  # --grad-compression powersgd: residuals and Q
    optimizer += outer_state_bytes(model, cfg)  # DiLoCo's θ_outer and momentum (plan/diloco.py)
    if cfg.optimizer.optimizer == OptimizerKind.MUON:  # the hidden matrices keep one buffer, not Adam's two (plan/muon_stage.py)
        saved = muon_state_saved(model, cfg, stage, rank=rank)
        optimizer, host = (optimizer, host - saved) if cfg.parallel.offload_optimizer else (optimizer - saved, host)
    return weights, grads, optimizer, host


def estimate_model_states(num_params: int, cfg: RunConfig, convention: str = "zero-paper") -> Estimate:
    """Model-state-only estimate from a raw parameter count (no activations, no model shape).

    Parameters are split evenly over tp * pp. With the ZeRO paper's accounting (the default;
    see `model_state_bytes`) it reproduces the paper's Figure 1 example: 7.5e9 params,
    RunConfig.build(dp=64, precision="fp16", grad_reduce_dtype="fp16", zero=0..3).
    """
    check_degrees(cfg)
    params = math.ceil(num_params / (cfg.parallel.tp * cfg.parallel.pp))
    weights, grads, optimizer, host = model_state_bytes(params, cfg, convention)
    comm: dict[str, int] = {}
    add_dp_bytes(lambda key, n: comm.__setitem__(key, comm.get(key, 0) + n) if n else None, params, cfg)
    tokens = cfg.global_batch_size * (cfg.model.seq_length or 0)
    return Estimate(param_bytes=weights, grad_bytes=grads, optimizer_state_bytes=optimizer, activation_bytes=0,
                    params_per_rank=params, stage=0, layers_on_stage=0, inflight_microbatches=0,
                    num_microbatches=cfg.num_microbatches, bubble_fraction=0.0, comm_bytes=comm,
                    flops_per_step=6.0 * num_params * tokens, hardware_flops_per_step=6.0 * num_params * tokens,
                    tokens_per_step=tokens, host_bytes=host, stage_totals=[weights + grads + optimizer])
