"""What a run says about itself at start (after the mesh exists, before the first step).

The mesh, the model's shape, the batch split, precision and schedule, the planner's per-rank memory
and step time (a GPU profile's figure on a CPU, said as such), this machine's notes, and which
attention implementation the blocks run. `log` is the loop's rank-0 printer.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from megalite import ops
from megalite.config.rampup import BatchRampup
from megalite.config import RunConfig
from megalite.config.choices import Fp8Scales, Fp8ScalingRecipe
from megalite.config.model import GPTConfig
from megalite.distributed.mesh import Mesh
from megalite.plan import estimate, justify
from megalite.plan.hardware import builtin_for_device
from megalite.training.launch_checks import machine_notes


def attention_run(cfg: RunConfig, model_cfg: GPTConfig, device: torch.device) -> str | None:
    """The attention implementation the model's blocks run on this GPU, for the planner to count what
    it keeps; None off CUDA, where the estimate is a GPU's (the planner's choice, as logged)."""
    if device.type != "cuda":
        return None
    if model_cfg.mla is not None:  # ops.latent_attention: SDPA on every device
        return "sdpa"
    return ops.attention_implementation(model_cfg.head_dim, model_cfg.num_attention_heads, model_cfg.num_query_groups,
                                       model_cfg.seq_length, cfg.training_dtype, model_cfg.attention_dropout,
                                       cfg.parallel.cp, cfg.parallel.cp_comm_type, device)


def announce(cfg: RunConfig, model_cfg: GPTConfig, mesh: Mesh, log: Callable[..., None]) -> None:
    """The start lines: mesh, model, batch and precision, the planned layout and the attention path."""
    plan = estimate(model_cfg, cfg, attention_run(cfg, model_cfg, mesh.device))
    log(mesh.describe())
    log(f"model: {model_cfg.flavour} {model_cfg.num_layers} layers, h={model_cfg.hidden_size}, "
        f"heads={model_cfg.num_attention_heads}/{model_cfg.num_query_groups}, {model_cfg.num_params() / 1e6:.2f}M "
        f"params, vocab {model_cfg.vocab_size} (padded {model_cfg.padded_vocab_size(cfg.parallel.tp)}), "
        f"seq {model_cfg.seq_length}")
    log(f"batch: global {cfg.global_batch_size} = micro {cfg.training.micro_batch_size} x dp {cfg.dp} x "
        f"accumulation {cfg.num_microbatches}; "
        + (f"cp {cfg.parallel.cp} ({cfg.parallel.cp_comm_type}): {model_cfg.seq_length // cfg.parallel.cp} tokens "
           f"of each sequence per rank; " if cfg.parallel.cp > 1 else "")
        + f"{cfg.precision.precision}{_fp8_words(cfg, mesh)}; schedule "
        f"{cfg.schedule if cfg.parallel.pp > 1 else 'none'}; zero {cfg.parallel.zero}; estimated "
        f"{plan.total_bytes / 1e9:.2f} GB per rank")
    # the step time on the built-in profile of this GPU (H100-SXM where none matches, and on a CPU)
    gpu = builtin_for_device(torch.cuda.get_device_name(mesh.device)) if mesh.device.type == "cuda" else None
    layout = justify(model_cfg, cfg, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), hardware=gpu)
    if gpu is None:  # the figure is a GPU profile's, not this machine's: say so (the steps below measure it)
        layout += " (a GPU profile's estimate, not this machine's; the step lines below measure this one)"
    log("layout: " + layout)
    if cfg.training.rampup_batch_size is not None:
        log(rampup_line(cfg))
    p = cfg.parallel
    for note in machine_notes(cfg, mesh.device.type == "cuda"):
        log(note)
    if model_cfg.mla is not None:
        log(ops.describe_latent_attention(model_cfg.mla.qk_dim, model_cfg.mla.v_head_dim))
        return
    log(ops.describe_attention(model_cfg.head_dim, model_cfg.num_attention_heads, model_cfg.num_query_groups,
                              model_cfg.seq_length, cfg.training_dtype, model_cfg.attention_dropout, p.cp,
                              p.cp_comm_type, mesh.device))


def rampup_line(cfg: RunConfig) -> str:
    """--rampup-batch-size in words: the batches, their microbatches, when the full batch is reached."""
    ramp, iters = BatchRampup.of(cfg), cfg.training.train_iters
    unit = cfg.training.micro_batch_size * cfg.dp
    full = ramp.ramp_steps() + 1  # the first step at the full batch
    samples = ramp.samples_in(iters, 0)
    return (f"batch ramp-up: global {ramp.start} -> {ramp.global_batch_size} by {ramp.increment} over "
            f"{ramp.samples} samples ({ramp.start // unit} -> {cfg.num_microbatches} microbatches); "
            + (f"the full batch from step {full}" if full <= iters else
               f"--train-iters {iters} ends inside the ramp, at batch {ramp.batch_sizes(iters)[-1]}")
            + f"; {samples} samples in the run; the learning rate follows the samples (warm-up and decay "
              f"steps counted at the full batch); the layout and memory were planned at the full batch")


def _fp8_words(cfg: RunConfig, mesh: Mesh) -> str:
    prec = cfg.precision
    if prec.fp8_format is None:
        return ""
    where = " (torch._scaled_mm on a CPU: for testing, not speed)" if mesh.device.type == "cpu" else ""
    if prec.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE:  # no scaled GEMM computes per-128 scales: fp32 on dequantised tiles
        where = " (a torch reference: numerics, not speed)"
    scales = "" if prec.fp8_scales == Fp8Scales.POW2 else " (exact scales)"
    return (f" + fp8 {prec.fp8_format} {prec.fp8_recipe}{scales} GEMMs{where}"
            + ("; FP8 parameter gathers" if prec.fp8_param_gather else ""))
