"""Pre-flight: every configuration problem the planner can see, each naming its fix.

`preflight()` runs where a run starts (megalite.training.launch_checks, before any process group
exists, on every rank, on the same settings, so every rank stops with the same message and
nothing hangs) and in `tools/plan.py`. When a GPU's
memory is given, a layout that does not fit gets the first change that makes it fit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.rampup import rampup_problems
from megalite.context_parallel.checks import context_parallel_problems
from megalite.config.model import GPTConfig
from megalite.pipeline.schedules import check_schedule_args
from megalite.layout import LayoutError
from megalite.plan.per_rank import estimate
from megalite.plan.layout import GB, stage_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def preflight(model: GPTConfig, cfg: RunConfig, world_size: int, gpu_memory: float | None = None,
              memory_of: str | None = None) -> list[str]:
    """Every problem with this layout, each naming its fix; [] when the run may start.

    Memory is checked (when gpu_memory bytes are given) only once the layout itself is valid;
    `memory_of` says whose memory that is in the message (e.g. "this machine's RAM / 8 ranks").
    """
    try:  # the sizes first (megalite.layout): a bad layout is one line, the same as init_mesh's
        cfg.layout(world_size, model)
        errors = []
    except LayoutError as exc:
        errors = [str(exc)]
    p = cfg.parallel
    if not all(isinstance(n, int) and n >= 1 for n in (p.tp, p.pp, p.cp, cfg.dp, p.virtual_stages,
                                                        cfg.training.micro_batch_size)):
        return errors or [f"--micro-batch-size must be a positive integer, got {cfg.training.micro_batch_size!r}"]
    errors += _layout_errors(model, cfg) + _batch_errors(cfg) + _context_parallel_errors(model, cfg)
    tp, seq = cfg.parallel.tp, model.seq_length
    if cfg.parallel.sequence_parallel and tp == 1:
        errors.append("sequence parallelism shards along the tensor-parallel group; drop --sequence-parallel "
                      "or set --tp > 1")
    if cfg.parallel.sequence_parallel and seq % tp:
        errors.append(f"seq_length={seq} is not divisible by tp={tp} (sequence parallelism splits it); choose "
                      f"seq_length a multiple of {tp}")
    if errors or not gpu_memory:
        return errors
    est = estimate(model, cfg)
    if not est.fits(gpu_memory):
        whose = f" ({memory_of})" if memory_of else ""
        errors.append(f"estimated {est.total_bytes / GB:.2f} GB per rank (stage {est.stage}) does not fit "
                      f"{gpu_memory / GB:.1f} GB{whose} with 10% headroom; {memory_fix(model, cfg, gpu_memory)}")
    return errors


def _layout_errors(model: GPTConfig, cfg: RunConfig) -> list[str]:
    """tp divisibility of the model, and the pipeline split (the world size: the layout, checked before)."""
    errors = []
    for check in (lambda: model.check_tensor_parallel(cfg.parallel.tp),
                  lambda: stage_layers(model, cfg)):
        try:
            check()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _context_parallel_errors(model: GPTConfig, cfg: RunConfig) -> list[str]:
    """The sequence split over cp (2*cp chunks; /tp under SP) and what the attention method needs."""
    p = cfg.parallel
    return context_parallel_problems(model.seq_length, p.cp, str(p.cp_comm_type), model.num_attention_heads,
                                     model.num_query_groups, p.tp, p.sequence_parallel, model.attention_dropout)


def _batch_errors(cfg: RunConfig) -> list[str]:
    """Batch arithmetic and the pipeline schedule's rules."""
    errors = []
    mb, dp, pp, v = cfg.training.micro_batch_size, cfg.dp, cfg.parallel.pp, cfg.parallel.virtual_stages
    if cfg.global_batch_size % (mb * dp):
        errors.append(f"global_batch_size={cfg.global_batch_size} is not divisible by micro_batch_size*dp = "
                      f"{mb}*{dp} = {mb * dp}; choose a multiple of {mb * dp}")
    errors += rampup_problems(cfg)  # --rampup-batch-size: every batch of the ramp, not only the last
    m = cfg.num_microbatches
    if pp > 1 and m < pp:
        errors.append(f"{m} microbatches < pp={pp} stages: the pipeline never fills; set --global-batch-size "
                      f">= micro_batch_size*dp*pp = {mb * dp * pp} (more microbatches also shrink the bubble)")
    if pp > 1:  # (virtual stages at pp 1: the layout's rule)
        try:
            check_schedule_args(cfg.schedule, pp, m, v)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def _why_this_step(model: GPTConfig, cfg: RunConfig, flag: str) -> str:
    """Practitioners' order (ZeRO-2, then ZeRO-3, then offload): the size of the step before."""
    before = {"--zero 3": ("--zero 2", dict(zero=2)), "--offload-optimizer": ("--zero 3", dict(zero=3))}.get(flag)
    if before is None or cfg.dp == 1:
        return ""
    needed = estimate(model, cfg.replace(**before[1])).total_bytes
    return f" ({before[0]} would still need {needed / GB:.2f} GB)"


def memory_fix(model: GPTConfig, cfg: RunConfig, gpu_memory: float) -> str:
    """Name the first single change that makes the layout fit, or point at the planner."""
    tries = [("--fused-linear-cross-entropy", dict(fused_linear_cross_entropy=True)),
             ("--recompute selective", dict(recompute="selective")),
             ("--zero 1", dict(zero=1)), ("--zero 2", dict(zero=2)), ("--zero 3", dict(zero=3)),
             ("--recompute full", dict(recompute="full"))]
    if cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        tries.insert(1, ("--sequence-parallel", dict(sequence_parallel=True)))
    if cfg.training.micro_batch_size > 1:  # the global batch stays: twice the microbatches
        tries.append((f"--micro-batch-size {cfg.training.micro_batch_size // 2}",
                      dict(micro_batch_size=cfg.training.micro_batch_size // 2)))
    doubled = cfg.replace(cp=2 * cfg.parallel.cp, dp=cfg.dp // 2)  # same ranks: each sequence split 2x more
    if cfg.dp % 2 == 0 and not _context_parallel_errors(model, doubled):
        tries.append((f"--cp {doubled.parallel.cp} --dp {doubled.dp}", dict(cp=doubled.parallel.cp, dp=doubled.dp)))
    tries.append(("--offload-optimizer", dict(offload_optimizer=True)))
    current = cfg.flat()
    tries = [(flag, change) for flag, change in tries
             if not (cfg.dp * cfg.parallel.cp == 1 and "zero" in change) and not all(current[k] == val for k, val in change.items())]
    for flag, change in tries:  # one change alone
        if estimate(model, cfg.replace(**change)).fits(gpu_memory):
            return f"add {flag}" + _why_this_step(model, cfg, flag)
    flags, combined = [], cfg
    for flag, change in tries:  # or several, cumulatively, in order of cost
        flags.append(flag)
        combined = combined.replace(**change)
        if estimate(model, combined).fits(gpu_memory):
            kept = [f for i, f in enumerate(flags) if f.split()[0] not in {g.split()[0] for g in flags[i + 1:]}]
            if flag in ("--zero 3", "--offload-optimizer"):  # why this last step was needed
                without = estimate(model, combined.replace(**{"zero": 2} if flag == "--zero 3" else
                                                           {"offload_optimizer": False})).total_bytes
                return f"add {' '.join(kept)} (without {flag}: {without / GB:.2f} GB)"
            return f"add {' '.join(kept)}"
    plan = estimate(model, combined)  # everything above applied: what is left is mostly weights or activations
    if plan.activation_bytes > plan.total_bytes / 2:  # more GPUs per replica would not shrink a sequence's activations
        return (f"activations ({plan.activation_bytes / GB:.2f} GB even with the changes above) dominate: shorten "
                f"--seq-length, or split each sequence over more ranks with --cp; `tools/plan.py --suggest` lists "
                f"layouts that fit")
    return "raise --tp/--pp (more GPUs per model replica); `tools/plan.py --suggest` lists layouts that fit"
