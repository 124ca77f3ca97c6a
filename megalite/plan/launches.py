"""GPU operations (kernel launches, memsets, copies) megalite's training step issues, counted from the
model's structure, and the host time they cost (pure arithmetic, no torch).

Each GPU operation costs the host a roughly fixed time (Python, autograd, torch's dispatcher, the
launch itself): `HardwareProfile.launch_host_us`. A step whose GPU work per operation is shorter
than that is host-bound (a small model, a short sequence, a pipeline stage with small microbatches).
With CUDA graphs (--cuda-graph) each microbatch's forward and backward are captured as one graph
and replayed: one launch; the optimizer step stays eager.

Counts per transformer block (tensor-parallel collectives not counted: they are timed as
communication), as the code issued them on the H200 trace of a gpt2-124m step
(../shared/gpu/2026-11-26-h200/gpt2_trace.json.gz: 15 forward, 52 backward per block; 961 per step;
49 backward and 925 per step since the q/k/v copies below went) and the llama-1b profile
(llama_prof.tgz: 60 per block, 1448 per step):
  forward   two norms; four GEMMs; the column-parallel pair's (QKV, fc1) memsets and, with biases,
            their bias adds; attention's kernel and its output made [s, b, h]; two bias-dropout-adds;
            the activation (SwiGLU: its gate and up halves made contiguous first); RoPE on q and k;
  backward  two GEMMs and a main-grad add per linear; a bias's gradient: memset, sum, add (the two
            the bias-dropout-add owns: memset, sum, cast, add); per norm: its kernel, and per
            parameter a sum, a cast and an add; attention's three kernels, its output gradient made
            contiguous (neither copy with the Triton kernels since issue 26: they write their output
            and read its gradient in the [s, b, h] layout, `output_in_place`), the q/k/v gradients
            concatenated (one copy: `ops.split_heads`; the traces also copied each one no
            RoPE wrote first, 3 launches per gpt2 block, 1 per llama block, gone since issue 26);
            the activation's kernel (SwiGLU: and the gate/up concatenation); RoPE on q and k; the
            residual gradients' two adds;
  memsets   besides those named: `BLOCK_MEMSETS` per block of each flavour, as the profiles count them.
Outside the blocks, per microbatch, `MICROBATCH_LAUNCHES` (embedding, final norm, output layer,
cross entropy and the loss's bookkeeping), and per step `OPTIMIZER_LAUNCHES` plus `BUCKET_LAUNCHES`
per gradient bucket: the gpt2 trace's counts (on llama-1b they gave 1499 per step, 1477 now, against
its profile's 1448: its embedding, final norm and loss issue fewer than gpt2's, and its 970M
parameters fill 23 buckets, not 25). The host-overhead work of issue 26 changes all of these:
count them again (tools/bench_host_overhead.py counts a real step's launches) when it lands.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan.activations import output_kept_once, planned_attention
from megalite.plan.hardware import HardwareProfile
from megalite.plan.layout import head_stage, stage_layers
from megalite.plan.params import stage_params

if TYPE_CHECKING:
    from megalite.config import RunConfig

BLOCK_MEMSETS = {"gpt2": 1, "llama": 8}    # besides those named above, as the profiles count them
MICROBATCH_LAUNCHES = (27, 53)             # (forward, backward) outside the blocks, gpt2 trace
OPTIMIZER_LAUNCHES = 65                    # per step outside forward and backward, gpt2 trace (63 + 14
                                           # between the phases), less 4 per bucket:
BUCKET_LAUNCHES = 4                        # per gradient bucket: weight decay (two runs), AdamW, the publish


@dataclass(frozen=True)
class Launches:
    """GPU operations of one pass: forward and backward of a microbatch, or the optimizer's step."""

    forward: int
    backward: int


def block_launches(model: GPTConfig, output_in_place: bool = False) -> Launches:
    """GPU operations of one transformer block's forward and backward (one microbatch);
    `output_in_place`: attention's output and its gradient need no layout copy (the Triton kernels
    at cp = 1: `activations.output_kept_once`)."""
    bias, gated, rope = model.add_bias, model.flavour == "llama", model.flavour == "llama"
    norm_params = 1 if model.flavour == "llama" else 2
    copy = 0 if output_in_place else 1
    forward = 2 + 4 + 2 + (2 if bias else 0) + 1 + copy + 2 + 1 + (2 if gated else 0) + (2 if rope else 0)
    backward = 4 * 3 + (2 * 3 + 2 * 4 if bias else 0) + 2 * (1 + 3 * norm_params)
    backward += 3 + copy + 1 + 1 + (1 if gated else 0) + (2 if rope else 0) + 2
    return Launches(forward, backward + BLOCK_MEMSETS.get(model.flavour, 0))


def stage_launches(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None) -> Launches:
    """GPU operations of one microbatch's forward and backward on a pipeline stage (all its chunks);
    the embedding and loss count on the stages that hold them, half each where they are two.
    `attention`: the implementation the blocks run (`activations.planned_attention`)."""
    block = block_launches(model, output_kept_once(cfg, planned_attention(model, attention)))
    layers = stage_layers(model, cfg)[stage]
    share = 1.0 if cfg.parallel.pp == 1 else 0.5 * ((stage == 0) + (stage == head_stage(cfg)))
    return Launches(round(layers * block.forward + share * MICROBATCH_LAUNCHES[0]),
                    round(layers * block.backward + share * MICROBATCH_LAUNCHES[1]))


def optimizer_launches(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """GPU operations of a step outside forward and backward on a stage: the fixed ones and per bucket."""
    buckets = max(1, math.ceil(stage_params(model, cfg, stage) / cfg.parallel.ddp_bucket_size))
    return OPTIMIZER_LAUNCHES + BUCKET_LAUNCHES * buckets


def uses_cuda_graph(cfg: RunConfig) -> bool:
    """Whether the run replays captured CUDA graphs (--cuda-graph; False where the setting does not exist)."""
    return bool(getattr(cfg.training, "cuda_graph", False))


def host_seconds(hw: HardwareProfile, launches: int) -> float:
    """Host seconds of `launches` GPU operations at the profile's measured time per operation."""
    return launches * hw.launch_host_us * 1e-6


def queued_seconds(phases: list[tuple[float, float]]) -> float:
    """Seconds until the GPU finishes `phases` [(host seconds, GPU seconds), ...] issued in order by a
    host that never waits for the GPU (no sync inside): a queue. Phase j is issued by I_j = the hosts'
    sum so far; the GPU finishes it at F_j = max(F_{j-1} + its GPU time, I_j): a host-bound phase ends
    when its last operation is issued, a GPU-bound one when the GPU has worked through it."""
    issued = finished = 0.0
    for host, gpu in phases:
        issued += host
        finished = max(finished + gpu, issued)
    return finished
