"""Pipeline schedules as data: for every stage, the list of instructions it runs in order.

Instructions and their execution semantics are in instructions.py. A generator here gives
each stage's compute order; placement.py then inserts the transfers where both ends reach
them at the same time on an ideal clock, and the verifier's repair pass posts a receive
earlier wherever a send would otherwise wait forever. `_with_transfers` is the naive
placement (every receive just before its consumer), kept as the reference the tests show
deadlocking for interleaved 1F1B.

Schedules (p = pp, m = microbatches, v = virtual stages; bubble with equal per-op cost):
  gpipe        all forwards, then all backwards                   (p-1)/(m+p-1), peak m live
  1f1b         p-r-1 warm-up forwards, then one F one B            (p-1)/(m+p-1), peak p-r live
  interleaved  Megatron's interleaved 1F1B over v chunks per rank  (p-1)/(v*m+p-1)
  zb-h1        1F1B with backward split into B and W (Qi et al. 2023, "Zero Bubble Pipeline
               Parallelism"); W fills 1F1B's bubbles                (p-1)/(3m+p-1) at F=B=W, m>=p
"""
from __future__ import annotations

import functools

from megalite.config.choices import Schedule as ScheduleName
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, Instr, Schedule)
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk
from megalite.pipeline.partition import chunk_layer_counts
from megalite.pipeline.placement import place_transfers
from megalite.pipeline.verifier import repair_receive_order, verify_schedule

SCHEDULES = tuple(ScheduleName)  # the names --pipeline-schedule takes, declared once in config/choices.py


# ---------------------------------------------------------------------------------------------
# Compute orders
# ---------------------------------------------------------------------------------------------


def _interleaved_order(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's interleaved order: groups of pp microbatches per chunk.

    Forward: mb 0..pp-1 on chunk 0, mb 0..pp-1 on chunk 1, ..., then mb pp..2pp-1 on chunk 0...
    Backward: the same with chunks reversed (the last chunk's gradient is ready first).
    """
    order = []
    for k in range(m * v):
        chunk = (k // pp) % v
        microbatch = (k // (pp * v)) * pp + k % pp
        order.append((v - 1 - chunk if backward else chunk, microbatch))
    return order


def _gpipe(pp: int, m: int, v: int) -> list[list[Instr]]:
    fwd = [Instr(FWD, c, mb) for c, mb in _interleaved_order(pp, m, v, backward=False)]
    bwd = [Instr(BWD, c, mb) for c, mb in _interleaved_order(pp, m, v, backward=True)]
    return [fwd + bwd for _ in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Instr]]:
    stages = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        ops = [Instr(FWD, 0, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            ops += [Instr(FWD, 0, warmup + k), Instr(BWD, 0, k)]
        ops += [Instr(BWD, 0, mb) for mb in range(m - warmup, m)]
        stages.append(ops)
    return stages


def _interleaved(pp: int, m: int, v: int) -> list[list[Instr]]:
    fwd = _interleaved_order(pp, m, v, backward=False)
    bwd = _interleaved_order(pp, m, v, backward=True)
    return [_interleaved_stage(pp, m, v, r, fwd, bwd) for r in range(pp)]


def _interleaved_stage(pp: int, m: int, v: int, r: int, fwd: list[tuple[int, int]],
                       bwd: list[tuple[int, int]]) -> list[Instr]:
    """Rank r's compute instructions of the interleaved schedule (fwd, bwd: _interleaved_order's)."""
    total = m * v
    # Megatron: enough warm-up forwards that rank r's first backward input is on its way.
    warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
    ops = [Instr(FWD, *fwd[k]) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [Instr(FWD, *fwd[warmup + k]), Instr(BWD, *bwd[k])]
    ops += [Instr(BWD, *bwd[k]) for k in range(total - warmup, total)]
    return ops


def interleaved_compute(pp: int, m: int, v: int, r: int) -> list[Instr]:
    """Rank r's forwards and backwards of the interleaved schedule, in the order build_schedule runs
    them (it places transfers around them without reordering them), without building every stage
    and placing transfers: the planner counts activations in flight on one stage."""
    check_schedule_args(ScheduleName.INTERLEAVED, pp, m, v)
    return _interleaved_stage(pp, m, v, r, _interleaved_order(pp, m, v, backward=False),
                              _interleaved_order(pp, m, v, backward=True))


def _zb_h1(pp: int, m: int) -> list[list[Instr]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the handcrafted schedule).

    Stage r walks x = 0 .. m+pp-2 and runs the triple (F x, B x-(pp-1-r), W x-(pp-1)),
    skipping indices outside [0, m). B follows 1F1B's pairing, so at most pp - r microbatches
    sit between F and B (1F1B's activation peak); W lags F by pp-1 on every stage, filling
    the idle steps 1F1B leaves in warm-up and cool-down. With F = B = W the bubble is
    (pp-1) steps instead of 1F1B's 3(pp-1).
    """
    stages = []
    for r in range(pp):
        ops = []
        for x in range(m + pp - 1):
            for kind, mb in ((FWD, x), (BWD_INPUT, x - (pp - 1 - r)), (BWD_WEIGHT, x - (pp - 1))):
                if 0 <= mb < m:
                    ops.append(Instr(kind, 0, mb))
        stages.append(ops)
    return stages


# ---------------------------------------------------------------------------------------------
# Transfers around compute
# ---------------------------------------------------------------------------------------------


def _with_transfers(compute: list[list[Instr]], pp: int, v: int) -> Schedule:
    """Naive placement: receives just before their consumer, sends just after their producer."""
    schedule = []
    for r, ops in enumerate(compute):
        out: list[Instr] = []
        for op in ops:
            c, mb = op.chunk, op.microbatch
            first, last = is_first_chunk(pp, r, c), is_last_chunk(pp, v, r, c)
            if op.kind == FWD:
                out += ([] if first else [Instr(RECV_ACT, c, mb)]) + [op] + ([] if last else [Instr(SEND_ACT, c, mb)])
            elif op.kind in (BWD, BWD_INPUT):
                out += ([] if last else [Instr(RECV_GRAD, c, mb)]) + [op] + ([] if first else [Instr(SEND_GRAD, c, mb)])
            else:
                out.append(op)
        schedule.append(out)
    return schedule


def schedule_name(name: ScheduleName | str) -> ScheduleName:
    """`name` as the enum (a member, or the string a user types); ValueError naming the choices."""
    try:
        return ScheduleName(name)
    except ValueError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {[str(s) for s in SCHEDULES]}") from None


def check_schedule_args(name: ScheduleName | str, pp: int, num_microbatches: int, v: int = 1) -> None:
    """Raise ValueError naming the fix when `name` cannot run with (pp, microbatches, v)."""
    name = schedule_name(name)
    for label, value in (("pp", pp), ("num_microbatches", num_microbatches), ("virtual stages v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if v > 1 and pp == 1:
        raise ValueError(f"virtual stages (v={v}) need pp >= 2; with pp=1 set --virtual-stages 1")
    if name in (ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1) and v != 1:
        raise ValueError(f"schedule '{name}' runs one chunk per rank but v={v}; use 'interleaved' for "
                         f"virtual stages or set --virtual-stages 1")
    if name == ScheduleName.INTERLEAVED:
        if v < 2:
            raise ValueError("schedule 'interleaved' needs --virtual-stages >= 2; with v=1 use '1f1b'")
        if num_microbatches % pp != 0:
            raise ValueError(f"interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple "
                             f"of pp ({pp}); choose a global batch giving one of "
                             f"{[pp * k for k in range(1, 5)]}... microbatches")
    if name == ScheduleName.GPIPE and v > 1 and num_microbatches % pp != 0:
        raise ValueError(f"gpipe with v={v} virtual stages needs num_microbatches ({num_microbatches}) to be a "
                         f"multiple of pp ({pp}); or set --virtual-stages 1")


@functools.lru_cache(maxsize=64)
def _build(name: ScheduleName, pp: int, m: int, v: int, forward_only: bool) -> tuple[tuple[Instr, ...], ...]:
    if forward_only:  # evaluation: every forward in the interleaved order, no backward
        order = _interleaved_order(pp, m, v, backward=False)
        compute = [[Instr(FWD, c, mb) for c, mb in order] for _ in range(pp)]
    elif name == ScheduleName.GPIPE:
        compute = _gpipe(pp, m, v)
    elif name == ScheduleName.ONE_F_ONE_B:
        compute = _one_f_one_b(pp, m)
    elif name == ScheduleName.INTERLEAVED:
        compute = _interleaved(pp, m, v)
    else:
        compute = _zb_h1(pp, m)
    return tuple(tuple(ops) for ops in repair_receive_order(place_transfers(compute, pp, v), pp, v))


def build_schedule(name: ScheduleName | str, pp: int, num_microbatches: int, v: int = 1, forward_only: bool = False) -> Schedule:
    """The instruction list of every stage (index = pp rank) for schedule `name`.

    forward_only=True gives the evaluation schedule (forwards and activation transfers only)
    for the same (pp, microbatches, v); `name` is still validated.
    """
    name = schedule_name(name)
    check_schedule_args(name, pp, num_microbatches, v)
    return [list(ops) for ops in _build(name, pp, num_microbatches, v, forward_only)]


@functools.lru_cache(maxsize=32)
def verified_schedule(name: ScheduleName | str, pp: int, num_microbatches: int, v: int = 1,
                      forward_only: bool = False) -> tuple[tuple[Instr, ...], ...]:
    """build_schedule + verify_schedule, once per process and configuration."""
    schedule = build_schedule(name, pp, num_microbatches, v, forward_only)
    verify_schedule(schedule, pp, v, num_microbatches, forward_only)
    return tuple(tuple(ops) for ops in schedule)


def check_pipeline_config(schedule: ScheduleName | str, num_layers: int, pp: int, num_microbatches: int, v: int = 1,
                          first: int | None = None, last: int | None = None, layout=None) -> None:
    """Validate a pipeline configuration before any process group exists (for start-up checks).

    Raises ValueError naming the fix: more stages than layers, layers not divisible without a
    layout, interleaved with microbatches not a multiple of pp, ... Then builds and verifies
    the schedule once (cached), so a broken schedule fails here rather than hanging later.
    """
    chunk_layer_counts(num_layers, pp, v, first, last, layout)
    verified_schedule(schedule, pp, num_microbatches, v)
