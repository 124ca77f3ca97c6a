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
  dualpipev    DeepSeek's DualPipe cut in half (DeepSeek-V3 report, section 3.2.1; the DualPipe
               repository's DualPipeV): two chunks per rank in a V (partition.ChunkPlacement.V),
               B/W split where it fills bubbles; m >= 2p          (p-1)/(6m+p-1) at F=B=W
               (the published (p-1)(F&B + B - 3W) per rank is the clock of its F&B pairs run as
               one unit, (p-1)/(3m+p-1) at F&B = F + B: pipeline/overlap.py; here F runs before B)
"""
from __future__ import annotations

import functools
from collections import deque

from megalite.config.choices import Schedule as ScheduleName
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, Instr, Schedule)
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk
from megalite.pipeline.partition import ChunkPlacement, chunk_layer_counts
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


def _dualpipev(pp: int, m: int) -> list[list[Instr]]:
    return [_dualpipev_order(pp, m, r).ops for r in range(pp)]


def dualpipev_compute(pp: int, m: int, r: int) -> list[Instr]:
    """Rank r's compute instructions under DualPipeV, in the order build_schedule runs them (without
    placing transfers): the planner counts the activations a stage holds on it."""
    check_schedule_args(ScheduleName.DUALPIPEV, pp, m, 2)
    return _dualpipev_order(pp, m, r).ops


class _StageOrder:
    """A stage's compute list being written: each kind of each chunk takes its next microbatch,
    and the weight passes of split backwards wait in a queue, run oldest first. `pairs` are the
    instructions of each F&B pair DualPipe overlaps (run here one after the other)."""

    def __init__(self):
        self.ops: list[Instr] = []
        self.next: dict[tuple[str, int], int] = {}
        self.weights: deque[tuple[int, int]] = deque()
        self.pairs: list[tuple[Instr, ...]] = []

    def run(self, kind: str, chunk: int) -> None:
        """FWD; BWD_INPUT (its W queued); or BWD, a whole backward: B, then its W at once, so the input
        gradient leaves before the weight gradient is computed (one BWD would hold it back by W)."""
        counter = (FWD if kind == FWD else BWD, chunk)  # the backwards of a chunk share one count
        mb = self.next.get(counter, 0)
        self.next[counter] = mb + 1
        if kind == BWD:
            self.ops += [Instr(BWD_INPUT, chunk, mb), Instr(BWD_WEIGHT, chunk, mb)]
            return
        self.ops.append(Instr(kind, chunk, mb))
        if kind == BWD_INPUT:
            self.weights.append((chunk, mb))

    def weight(self) -> None:
        if self.weights:
            self.ops.append(Instr(BWD_WEIGHT, *self.weights.popleft()))

    def forward_backward(self, forward_chunk: int, backward_chunk: int, overlapped: bool = True) -> None:
        """F of one chunk then the whole backward of the other: one F&B pair of DualPipe's when `overlapped`."""
        self.run(FWD, forward_chunk)
        self.run(BWD, backward_chunk)
        if overlapped:
            self.pairs.append(tuple(self.ops[-3:]))  # (FWD, BWD_INPUT, BWD_WEIGHT)


def dualpipev_overlap_pairs(pp: int, m: int) -> list[list[tuple[Instr, ...]]]:
    """Per rank, DualPipe's F&B pairs: the (FWD, BWD_INPUT, BWD_WEIGHT) instructions of a forward and a
    whole backward it runs overlapped; megalite's executor runs them one after the other
    (pipeline/overlap.py replays each as one unit; docs/architecture/pipeline.md says what overlapping them would take)."""
    check_schedule_args(ScheduleName.DUALPIPEV, pp, m, 2)
    return [_dualpipev_order(pp, m, r).pairs for r in range(pp)]


def _dualpipev_order(pp: int, m: int, r: int) -> _StageOrder:
    """Rank r's compute under DualPipeV; local chunk 0 is model chunk r (the V's way down), local
    chunk 1 model chunk 2pp-1-r (the way back up). Eight phases, as the DualPipe repository's
    DualPipeV runs them; its F&B pairs run here one after the other, F first, and its whole
    backwards as B then their W at once (`_StageOrder.run`: on the executor's blocking transfers
    a whole BWD would hold a gradient back until its neighbour is mid-instruction, one stall per
    steady-state step; as B then W the ideal clock's bubble holds):

      1. 2(pp-r-1) x F0                      fill the way down
      2. r+1 x (F0 F1)                       the V's turn reaches this rank
      3. pp-r-1 x (B1 W F1)                  the first backwards split, W at once (zero bubble)
      4. m-2pp+r+1 x (F0 B1 F1 B0)           steady state: both chunks forward and backward
      5. pp-r-1 x (B1 F1 B0)                 chunk 0's forwards are done
      6. r+1 x (B1 B0)                       the last r+1 of these 2(r+1) backwards split
      7. pp-r-1 x (W B0), B0 split           weight passes fill the drain
      8. r+1 x W                             the weight passes left
    The F&B pairs are those of phases 4 and 5 (all but rank pp-1's first F0 B1, which DualPipe runs
    apart to keep its bubble small).
    """
    stage = _StageOrder()
    for _ in range(2 * (pp - r - 1)):
        stage.run(FWD, 0)
    for _ in range(r + 1):
        stage.run(FWD, 0)
        stage.run(FWD, 1)
    for _ in range(pp - r - 1):
        stage.run(BWD_INPUT, 1)
        stage.weight()
        stage.run(FWD, 1)
    for i in range(m - 2 * pp + r + 1):
        stage.forward_backward(0, 1, overlapped=not (i == 0 and r == pp - 1))
        stage.forward_backward(1, 0)
    for _ in range(pp - r - 1):
        stage.run(BWD, 1)
        stage.forward_backward(1, 0)
    for i in range(2 * (r + 1)):
        stage.run(BWD_INPUT if i >= r + 1 else BWD, 1 - i % 2)
    for _ in range(pp - r - 1):
        stage.weight()
        stage.run(BWD_INPUT, 0)
    for _ in range(r + 1):
        stage.weight()
    return stage


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


def chunk_placement(name: ScheduleName | str) -> ChunkPlacement:
    """Which model chunks each rank holds under schedule `name`: the V for DualPipeV, Megatron's
    interleaving for every other (partition.ChunkPlacement)."""
    return ChunkPlacement.V if schedule_name(name) == ScheduleName.DUALPIPEV else ChunkPlacement.INTERLEAVED


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
    if name == ScheduleName.DUALPIPEV:
        _check_dualpipev_args(pp, num_microbatches, v)
    if name == ScheduleName.GPIPE and v > 1 and num_microbatches % pp != 0:
        raise ValueError(f"gpipe with v={v} virtual stages needs num_microbatches ({num_microbatches}) to be a "
                         f"multiple of pp ({pp}); or set --virtual-stages 1")


def _check_dualpipev_args(pp: int, num_microbatches: int, v: int) -> None:
    if v != 2:
        raise ValueError(f"schedule 'dualpipev' holds two model chunks per rank (a V), but v={v}; set "
                         f"--virtual-stages 2")
    if pp < 2:
        raise ValueError("schedule 'dualpipev' needs pp >= 2; with pp=1 use '1f1b'")
    if num_microbatches < 2 * pp:
        raise ValueError(f"schedule 'dualpipev' needs at least 2*pp = {2 * pp} microbatches, got {num_microbatches}; "
                         f"raise --global-batch-size or lower --micro-batch-size to give {2 * pp} or more")


@functools.lru_cache(maxsize=64)
def _build(name: ScheduleName, pp: int, m: int, v: int, forward_only: bool) -> tuple[tuple[Instr, ...], ...]:
    placement = chunk_placement(name)
    if forward_only and name == ScheduleName.DUALPIPEV:  # evaluation: the training order's forwards
        compute = [[op for op in ops if op.kind == FWD] for ops in _dualpipev(pp, m)]
    elif forward_only:  # evaluation: every forward in the interleaved order, no backward
        order = _interleaved_order(pp, m, v, backward=False)
        compute = [[Instr(FWD, c, mb) for c, mb in order] for _ in range(pp)]
    elif name == ScheduleName.GPIPE:
        compute = _gpipe(pp, m, v)
    elif name == ScheduleName.ONE_F_ONE_B:
        compute = _one_f_one_b(pp, m)
    elif name == ScheduleName.INTERLEAVED:
        compute = _interleaved(pp, m, v)
    elif name == ScheduleName.ZB_H1:
        compute = _zb_h1(pp, m)
    else:
        compute = _dualpipev(pp, m)
    placed = place_transfers(compute, pp, v, placement)
    return tuple(tuple(ops) for ops in repair_receive_order(placed, pp, v, placement))


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
    verify_schedule(schedule, pp, v, num_microbatches, forward_only, placement=chunk_placement(name))
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
