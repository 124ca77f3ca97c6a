"""Decide before you launch: pre-flight checks, a step-time model, layout suggestions.

Built on `megalite.training.estimate` (the accounting). `preflight()` runs before any process
group exists and returns every configuration error with its fix; `suggest()` ranks layouts
that fit by the step-time model in `step_time()`; `justify()` is the one-line reason printed
at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.model.config import GPTConfig
from megalite.training.estimate import Estimate, _check_choices, bus_factor, estimate
from megalite.training.run_layout import GB, RECOMPUTE_CHOICES, Layout, stage_layers


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def preflight(model: GPTConfig, layout: Layout, world_size: int, gpu_memory: float | None = None) -> list[str]:
    """Every problem the planner can see, each naming its fix; [] when the run may start.

    Memory is checked (when gpu_memory bytes are given) only once the layout itself is valid.
    """
    from megalite.mesh import validate_layout
    from megalite.pipeline.schedules import check_schedule_args

    errors: list[str] = []
    try:
        _check_choices(layout)
    except ValueError as exc:
        return [str(exc)]
    tp, pp, v, mb = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batch_size
    try:
        validate_layout(world_size, tp, pp, layout.dp)
    except ValueError as exc:
        errors.append(str(exc))
    try:
        model.check_tensor_parallel(tp)
    except ValueError as exc:
        errors.append(str(exc))
    try:
        stage_layers(model, layout)
    except ValueError as exc:
        errors.append(str(exc))
    if layout.global_batch_size is not None and layout.global_batch_size % (mb * layout.dp):
        unit = mb * layout.dp
        errors.append(f"global_batch_size={layout.global_batch_size} is not divisible by micro_batch_size*dp = "
                      f"{mb}*{layout.dp} = {unit}; choose a multiple of {unit}")
    m = layout.microbatches()
    if layout.global_batch_size is not None and layout.num_microbatches is not None \
            and layout.global_batch_size != mb * layout.dp * layout.num_microbatches:
        errors.append(f"global_batch_size={layout.global_batch_size} != micro_batch_size*dp*num_microbatches = "
                      f"{mb}*{layout.dp}*{layout.num_microbatches}; give only one of them")
    if pp > 1 and m < pp:
        errors.append(f"{m} microbatches < pp={pp} stages: the pipeline never fills; set --global-batch-size "
                      f">= micro_batch_size*dp*pp = {mb * layout.dp * pp} (more microbatches also shrink the bubble)")
    if pp > 1 or v > 1:
        try:
            check_schedule_args(layout.schedule_name(), pp, m, v)
        except ValueError as exc:
            errors.append(str(exc))
    seq = layout.seq_length or model.seq_length
    if layout.sequence_parallel and tp == 1:
        errors.append("sequence parallelism shards along the tensor-parallel group; drop --sequence-parallel "
                      "or set --tp > 1")
    if layout.sequence_parallel and seq % tp:
        errors.append(f"seq_length={seq} is not divisible by tp={tp} (sequence parallelism splits it); choose "
                      f"seq_length a multiple of {tp}")
    if layout.zero_stage == 3:
        errors.append("megalite's optimizer shards up to ZeRO-2 (ZeRO-3 is modelled by tools/plan.py only); "
                      "use --zero 2 or more tp/pp")
    if model.flavour == "gpt2" and seq > model.seq_length:
        errors.append(f"seq_length={seq} exceeds the learned position table ({model.seq_length}); set the "
                      f"model's --seq-length to at least {seq}")
    if errors or not gpu_memory:
        return errors
    est = estimate(model, layout)
    if not est.fits(gpu_memory):
        errors.append(f"estimated {est.total_bytes / GB:.2f} GB per rank (stage {est.stage}) does not fit "
                      f"{gpu_memory / GB:.1f} GB with 10% headroom; {_memory_fix(model, layout, gpu_memory)}")
    return errors


def _memory_fix(model: GPTConfig, layout: Layout, gpu_memory: float) -> str:
    """Name the first single change that makes the layout fit, or point at the planner."""
    tries = [("--fused-linear-cross-entropy", dict(fused_linear_cross_entropy=True)),
             ("--recompute selective", dict(recompute="selective")),
             ("--zero 1", dict(zero_stage=1)), ("--zero 2", dict(zero_stage=2)),
             ("--recompute full", dict(recompute="full"))]
    if layout.tp > 1 and not layout.sequence_parallel:
        tries.insert(1, ("--sequence-parallel", dict(sequence_parallel=True)))
    if layout.micro_batch_size > 1:
        tries.append((f"--micro-batch-size {layout.micro_batch_size // 2}", dict(
            micro_batch_size=layout.micro_batch_size // 2,
            num_microbatches=None if layout.num_microbatches is None else 2 * layout.num_microbatches)))
    tries.append(("--offload-optimizer", dict(offload_optimizer=True)))
    tries = [(flag, change) for flag, change in tries
             if not (layout.dp == 1 and "zero_stage" in change)
             and not all(getattr(layout, k) == val for k, val in change.items() if k != "num_microbatches")]
    for flag, change in tries:  # one change alone
        if estimate(model, dataclasses.replace(layout, **change)).fits(gpu_memory):
            return f"add {flag}"
    flags, combined = [], layout
    for flag, change in tries:  # or several, cumulatively, in order of cost
        flags.append(flag)
        combined = dataclasses.replace(combined, **change)
        if estimate(model, combined).fits(gpu_memory):
            return f"add {' '.join(f for f in flags if f.split()[0] not in {g.split()[0] for g in flags[flags.index(f) + 1:]})}"
    return "raise --tp/--pp (more GPUs per model replica); `tools/plan.py --suggest` lists layouts that fit"


# ---------------------------------------------------------------------------------------------
# Suggest: layouts that fit, ranked by a simple step-time model
# ---------------------------------------------------------------------------------------------


@dataclass
class Suggestion:
    layout: Layout
    estimate: Estimate
    step_time_s: float
    reason: str


def step_time(model: GPTConfig, layout: Layout, est: Estimate, gpus_per_node: int, peak_flops: float = 989e12,
              efficiency: float = 0.5, intra_node_busbw: float = 360e9, inter_node_busbw: float = 40e9) -> dict:
    """Seconds per step, by part, under stated assumptions (for ranking layouts, not a promise).

    Compute runs at `efficiency` of `peak_flops` and is stretched by the pipeline bubble; TP and
    PP traffic is exposed; DP gradient reduction hides behind the last microbatch's backward;
    the post-step parameter all-gather is exposed; each block costs ~30 us of launch overhead per
    microbatch. A group's bandwidth is NVLink-class when its
    ranks fit in one node (Megatron order: tp spans tp ranks, dp spans tp*dp, pp the world).
    """
    span = {"tp": layout.tp, "dp": layout.tp * layout.dp, "pp": layout.world_size, "embedding": layout.world_size}
    size = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "embedding": 2}
    compute = est.hardware_flops_per_step / layout.world_size / (peak_flops * efficiency)
    # kernel-launch and small-GEMM overhead: ~30 us per block and microbatch (favours larger microbatches)
    compute += 30e-6 * est.layers_on_stage * est.num_microbatches
    compute /= 1.0 - est.bubble_fraction
    parts = {"compute": compute, "tp": 0.0, "pp": 0.0, "dp": 0.0, "embedding": 0.0, "offload": 0.0}
    for key, n in est.comm_bytes.items():
        group, op = key.split("/")
        bw = intra_node_busbw if span[group] <= gpus_per_node else inter_node_busbw
        seconds = n * bus_factor(op, size[group]) / bw
        if group == "pp" and op == "recv":
            continue  # a transfer is one send and one receive: count it once
        if group == "dp" and op != "all_gather":
            seconds = max(0.0, seconds - 2.0 / 3.0 * compute / est.num_microbatches)
        parts[group] += seconds
    if layout.offload_optimizer:  # grads down, params up over PCIe (~25 GB/s), CPU Adam (~1e9 params/s)
        shard = est.params_per_rank / (layout.dp if layout.zero_stage else 1)
        parts["offload"] = shard * 6 / 25e9 + shard / 1e9
    parts["total"] = sum(parts.values())
    return parts


def _reason(layout: Layout, est: Estimate, parts: dict, gpu_memory: float | None, gpus_per_node: int) -> str:
    bits = []
    if layout.tp > 1:
        where = "NVLink" if layout.tp <= gpus_per_node else "across nodes"
        bits.append(f"tp={layout.tp} on {where} ({parts['tp'] / parts['total']:.0%} of the step)")
    if layout.pp > 1:
        bits.append(f"pp={layout.pp}{f'x{layout.virtual_stages} chunks' if layout.virtual_stages > 1 else ''} "
                    f"bubble {est.bubble_fraction:.0%}")
    if layout.tp * layout.pp == 1:
        bits.append("pure data parallel (model fits one GPU)")
    if layout.zero_stage:
        bits.append(f"ZeRO-{layout.zero_stage} shards {('optimizer', 'optimizer+grads', 'all states')[layout.zero_stage - 1]} "
                    f"over dp={layout.dp}")
    if layout.recompute != "none":
        bits.append(f"{layout.recompute} recompute (+{est.hardware_flops_per_step / est.flops_per_step - 1:.0%} FLOPs)")
    if layout.offload_optimizer:
        bits.append("optimizer offloaded to host")
    bits.append(f"{est.total_bytes / GB:.1f}/{gpu_memory / GB:.0f} GB" if gpu_memory
                else f"{est.total_bytes / GB:.1f} GB per rank")
    return f"~{parts['total']:.3g} s/step: " + "; ".join(bits)


def justify(model: GPTConfig, layout: Layout, gpu_memory: float | None = None, gpus_per_node: int | None = None,
            peak_flops: float = 989e12) -> str:
    """The planner's one-line account of a chosen layout (as --suggest words it), for the run's
    start banner and the file saved beside checkpoints."""
    est = estimate(model, layout)
    gpus_per_node = gpus_per_node or layout.tp
    return _reason(layout, est, step_time(model, layout, est, gpus_per_node, peak_flops), gpu_memory, gpus_per_node)


def suggest(model: GPTConfig, gpus: int, gpu_memory: float, nodes: int = 1, gpus_per_node: int | None = None,
            global_batch_size: int | None = None, seq_length: int | None = None, precision: str = "bf16",
            top_k: int = 10, peak_flops: float = 989e12, **bandwidths) -> list[Suggestion]:
    """Layouts of `gpus` GPUs that fit `gpu_memory` bytes, fastest first, with a reason each.

    Tries tp within a node (sequence parallel when tp > 1), every pp dividing num_layers,
    interleaving, ZeRO 0-1, recompute none/selective/full, micro batch 1-8, and the optimizer
    offload only when nothing else fits. global_batch_size defaults to 8 sequences per GPU.
    """
    gpus_per_node = gpus_per_node or max(1, gpus // nodes)
    global_batch_size = global_batch_size or 8 * gpus
    found: list[Suggestion] = []
    for offload in (False, True):
        for tp in [d for d in _divisors(gpus_per_node) if gpus % d == 0]:
            try:
                model.check_tensor_parallel(tp)
            except ValueError:
                continue
            for pp in [d for d in _divisors(gpus // tp) if model.num_layers % d == 0]:
                dp = gpus // (tp * pp)
                for v in (1, 2) if pp > 1 else (1,):
                    for zero in (0, 1) if dp > 1 else (0,):  # megalite's ZeRO-2 peaks like ZeRO-1
                        for recompute in RECOMPUTE_CHOICES:
                            for mb in (1, 2, 4, 8):
                                layout = Layout(tp=tp, pp=pp, dp=dp, virtual_stages=v, zero_stage=zero,
                                                offload_optimizer=offload, recompute=recompute,
                                                sequence_parallel=tp > 1, micro_batch_size=mb, seq_length=seq_length,
                                                global_batch_size=global_batch_size, precision=precision)
                                if preflight(model, layout, gpus):
                                    continue
                                est = estimate(model, layout)
                                if not est.fits(gpu_memory):
                                    continue
                                parts = step_time(model, layout, est, gpus_per_node, peak_flops, **bandwidths)
                                found.append(Suggestion(layout, est, parts["total"],
                                                        _reason(layout, est, parts, gpu_memory, gpus_per_node)))
        if found:
            break
    rank = {r: i for i, r in enumerate(RECOMPUTE_CHOICES)}
    found.sort(key=lambda c: (round(c.step_time_s, 4), c.layout.tp * c.layout.pp, c.layout.zero_stage,
                              rank[c.layout.recompute], c.layout.virtual_stages))
    return found[:top_k]
