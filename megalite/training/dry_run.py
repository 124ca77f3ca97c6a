"""What `pretrain_gpt --dry-run` prints: the per-rank plan, memory advice, and a one-line verdict.

    verdict: fits (52.1 GB of 72.0 GB usable on an 80 GB H100-SXM); ~1.23 s/step on H100-SXM; change: nothing
    verdict: does NOT fit (112 GB per rank, stage 0; 72.0 GB usable on ...); ~2.1 s/step ...; change: add --zero 1

The device judged is this machine's GPU when it has one (its memory, and the built-in profile of its
kind for the step time), else an 80 GB H100-SXM, the planner's default profile: a dry run on a
laptop plans the cluster job. "Usable" keeps the planner's 10% headroom (Estimate.fits). What to
change: the first change that makes the layout fit (validity.memory_fix), else the largest part of
the step the advice limits flag (the bubble, exposed data-parallel communication), else nothing.
When activations outweigh the model states, a line before the verdict lists what each
activation-saving change would leave per rank and cost in step time.
"""
from __future__ import annotations

import torch

from megalite.config.choices import Precision, Recompute
from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.plan.hardware import DEFAULT, builtin_for_device, load_profile
from megalite.plan.per_rank import estimate
from megalite.plan.timing import predict_step_time
from megalite.plan.units import human_bytes
from megalite.plan.validity import memory_fix
from megalite.training.advice import BUBBLE_LIMIT, EXPOSED_DP_LIMIT

# device memory of the built-in profiles (datasheets), for a dry run on a machine without that GPU
BUILTIN_MEMORY = {"A100-80GB": 80e9, "H100-SXM": 80e9, "H200": 141e9}
HEADROOM = 0.1  # Estimate.fits' default


def target_device() -> tuple[float, str, str]:
    """(memory bytes, whose memory in words, hardware profile name) the dry run judges against."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        memory = float(torch.cuda.get_device_properties(0).total_memory)
        return memory, f"GPU 0 ({name}, {human_bytes(memory)})", builtin_for_device(name) or DEFAULT
    return BUILTIN_MEMORY[DEFAULT], f"an {human_bytes(BUILTIN_MEMORY[DEFAULT])} {DEFAULT} (no GPU here)", DEFAULT


def dry_run_report(cfg: RunConfig) -> str:
    """The whole dry-run text: the estimate's table, memory advice when it applies, the verdict."""
    model = cfg.gpt_config()
    memory, whose, hardware = target_device()
    lines = [estimate(model, cfg).describe(memory)]
    advice = memory_advice(model, cfg, hardware)
    if advice:
        lines.append(advice)
    lines.append(verdict(model, cfg, memory, whose, hardware))
    return "\n".join(lines)


def verdict(model: GPTConfig, cfg: RunConfig, gpu_memory: float, whose: str, hardware: str) -> str:
    """One line: fits or not, the predicted step time, and what to change."""
    est = estimate(model, cfg)
    parts = predict_step_time(model, cfg, hardware).breakdown()
    usable = human_bytes((1.0 - HEADROOM) * gpu_memory)
    step = f"~{parts['total']:.3g} s/step on {load_profile(hardware).name}"
    if not est.fits(gpu_memory):
        return (f"verdict: does NOT fit ({human_bytes(est.total_bytes)} per rank, stage {est.stage}; {usable} usable "
                f"on {whose}); {step}; change: {memory_fix(model, cfg, gpu_memory)}")
    return (f"verdict: fits ({human_bytes(est.total_bytes)} of {usable} usable on {whose}); {step}; change: "
            f"{_speed_change(cfg, parts)}")


def _speed_change(cfg: RunConfig, parts: dict) -> str:
    """For a layout that fits: the fix for the largest flagged part of the step, else nothing."""
    total, p = parts["total"], cfg.parallel
    flagged = []
    if parts["bubble"] > BUBBLE_LIMIT * total:
        more = "--virtual-stages 2" if p.virtual_stages == 1 and p.pp > 1 else "a larger --global-batch-size"
        flagged.append((parts["bubble"], f"the pipeline bubble is {parts['bubble'] / total:.0%} of the step: {more} "
                                         f"(or more microbatches)"))
    if parts["dp"] > EXPOSED_DP_LIMIT * total:
        fixes = ["--grad-reduce-dtype bf16"] if cfg.precision.grad_reduce_dtype == Precision.FP32 else []
        if p.zero in (1, 2) and not p.overlap_param_gather:
            fixes.append("--overlap-param-gather")
        fixes.append("a larger --micro-batch-size")
        flagged.append((parts["dp"], f"data-parallel communication is {parts['dp'] / total:.0%} of the step: "
                                     + " or ".join(fixes)))
    return max(flagged)[1] if flagged else "nothing"


def memory_advice(model: GPTConfig, cfg: RunConfig, hardware: str = DEFAULT) -> str:
    """When activations outweigh the model states: what each activation-saving change leaves per
    rank and costs in step time; "" otherwise."""
    est = estimate(model, cfg)
    states = est.param_bytes + est.grad_bytes + est.optimizer_state_bytes
    if est.activation_bytes <= states:
        return ""
    base = predict_step_time(model, cfg, hardware).total
    options = []
    for flag, change in _activation_changes(cfg):
        changed = cfg.replace(**change)
        try:
            after = estimate(model, changed)
        except ValueError:  # the change does not apply to this layout
            continue
        if after.total_bytes < est.total_bytes:
            cost = predict_step_time(model, changed, hardware).total / base - 1
            options.append(f"{flag}: {human_bytes(after.total_bytes)} ({cost:+.0%} step time)")
    return (f"advice: activations are {human_bytes(est.activation_bytes)} of the {human_bytes(est.total_bytes)} "
            f"per rank ({est.activation_bytes / est.total_bytes:.0%})" + ("; " + ", ".join(options) if options else ""))


def _activation_changes(cfg: RunConfig) -> list[tuple[str, dict]]:
    """The single changes that shrink saved activations, each as its flag and its settings."""
    p, mb = cfg.parallel, cfg.training.micro_batch_size
    changes = []
    if p.tp > 1 and not p.sequence_parallel:
        changes.append(("--sequence-parallel", dict(sequence_parallel=True)))
    if p.recompute == Recompute.NONE:
        changes.append(("--recompute selective", dict(recompute="selective")))
    if p.recompute != Recompute.FULL:
        changes.append(("--recompute full", dict(recompute="full")))
    if mb > 1:  # the global batch stays: twice the microbatches
        changes.append((f"--micro-batch-size {mb // 2}", dict(micro_batch_size=mb // 2)))
    if not p.fused_linear_cross_entropy:
        changes.append(("--fused-linear-cross-entropy", dict(fused_linear_cross_entropy=True)))
    return changes
