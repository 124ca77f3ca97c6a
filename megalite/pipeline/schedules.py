"""Pipeline schedules as data: for every stage, the list of instructions it runs in order.

An instruction is (kind, local chunk, microbatch). Compute kinds:
  FWD          forward of chunk c on microbatch m
  BWD          full backward (input and weight gradients)
  BWD_INPUT    zero-bubble "B": input gradient only; weight-gradient work is queued
  BWD_WEIGHT   zero-bubble "W": run the queued weight-gradient work of (c, m)
Transfer kinds (peers from p2p.peer): SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD.

Execution semantics (what the executor does and the verifier simulates): a maximal run of
consecutive transfer instructions is ONE batch, posted together; the stage waits for all
of them before its next compute instruction. Each pair of stages matches messages in
posting order, so the verifier checks that the k-th send a->b is the k-th receive at b.

Generators build the compute order per stage, then `_with_transfers` wraps each compute
instruction with the receives it needs (just before) and the sends it enables (just after),
so a send and the next receive share one batch: Megatron's send_forward_recv_backward.

Schedules (p = pp, m = microbatches, v = virtual stages; bubble with equal per-op cost):
  gpipe        all forwards, then all backwards                   (p-1)/(m+p-1)
  1f1b         p-r-1 warm-up forwards, then one F one B            (p-1)/(m+p-1), peak p-r live
  interleaved  Megatron's interleaved 1F1B over v chunks per rank  (p-1)/(v*m+p-1)
  zb-h1        1F1B with backward split into B and W (Qi et al. 2023, "Zero Bubble Pipeline
               Parallelism"); W fills bubbles; 1F1B's peak memory   (p-1)/(3m+p-1) at F=B=W
"""
from __future__ import annotations

import functools

from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, Instr, Schedule)
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk
from megalite.pipeline.verifier import repair_receive_order

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


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
    total = m * v
    stages = []
    for r in range(pp):
        # Megatron: enough warm-up forwards that rank r's first backward input is on its way.
        warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
        ops = [Instr(FWD, *fwd[k]) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [Instr(FWD, *fwd[warmup + k]), Instr(BWD, *bwd[k])]
        ops += [Instr(BWD, *bwd[k]) for k in range(total - warmup, total)]
        stages.append(ops)
    return stages


def _zb_h1(pp: int, m: int) -> list[list[Instr]]:
    """ZB-H1 order from a unit-cost list schedule (F = B = W = 1 time step, free transfers).

    At each step a stage runs, by priority: the next B whose gradient has arrived; else the
    next F if its input has arrived and fewer than pp - r microbatches hold activations
    (1F1B's peak; activations live until W); else the oldest pending W. Deferring W into the
    otherwise idle steps is what removes two thirds of 1F1B's bubble.
    """
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> step it finished
    next_f, next_b = [0] * pp, [0] * pp
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    done_w = [0] * pp
    stages: list[list[Instr]] = [[] for _ in range(pp)]
    step = 0
    while any(done_w[r] < m for r in range(pp)):
        for r in range(pp):
            def ready(key):
                return key in finished and finished[key] <= step

            b, f = next_b[r], next_f[r]
            if b < f and (r == pp - 1 or ready(("B", r + 1, b))) and ready(("F", r, b)):
                stages[r].append(Instr(BWD_INPUT, 0, b))
                finished[("B", r, b)] = step + 1
                next_b[r] += 1
                pending_w[r].append(b)
            elif f < m and (r == 0 or ready(("F", r - 1, f))) and f - done_w[r] < pp - r:
                stages[r].append(Instr(FWD, 0, f))
                finished[("F", r, f)] = step + 1
                next_f[r] += 1
            elif pending_w[r] and ready(("B", r, pending_w[r][0])):
                stages[r].append(Instr(BWD_WEIGHT, 0, pending_w[r].pop(0)))
                done_w[r] += 1
        step += 1
        if step > 10 * (m + pp) + 10:
            raise RuntimeError(f"zb-h1 generator made no progress (pp={pp}, m={m}); this is a bug")
    return stages


# ---------------------------------------------------------------------------------------------
# Transfers around compute
# ---------------------------------------------------------------------------------------------


def _with_transfers(compute: list[list[Instr]], pp: int, v: int) -> Schedule:
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


def check_schedule_args(name: str, pp: int, num_microbatches: int, v: int = 1) -> None:
    """Raise ValueError naming the fix when `name` cannot run with (pp, microbatches, v)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {SCHEDULES}")
    for label, value in (("pp", pp), ("num_microbatches", num_microbatches), ("virtual stages v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if v > 1 and pp == 1:
        raise ValueError(f"virtual stages (v={v}) need pp >= 2; with pp=1 set --virtual-stages 1")
    if name in ("1f1b", "zb-h1") and v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank but v={v}; use 'interleaved' for "
                         f"virtual stages or set --virtual-stages 1")
    if name == "interleaved":
        if v < 2:
            raise ValueError("schedule 'interleaved' needs --virtual-stages >= 2; with v=1 use '1f1b'")
        if num_microbatches % pp != 0:
            raise ValueError(f"interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple "
                             f"of pp ({pp}); choose a global batch giving one of "
                             f"{[pp * k for k in range(1, 5)]}... microbatches")
    if name == "gpipe" and v > 1 and num_microbatches % pp != 0:
        raise ValueError(f"gpipe with v={v} virtual stages needs num_microbatches ({num_microbatches}) to be a "
                         f"multiple of pp ({pp}); or set --virtual-stages 1")


@functools.lru_cache(maxsize=64)
def _build(name: str, pp: int, m: int, v: int) -> tuple[tuple[Instr, ...], ...]:
    if name == "gpipe":
        compute = _gpipe(pp, m, v)
    elif name == "1f1b":
        compute = _one_f_one_b(pp, m)
    elif name == "interleaved":
        compute = _interleaved(pp, m, v)
    else:
        compute = _zb_h1(pp, m)
    return tuple(tuple(ops) for ops in repair_receive_order(_with_transfers(compute, pp, v), pp, v))


def build_schedule(name: str, pp: int, num_microbatches: int, v: int = 1) -> Schedule:
    """The instruction list of every stage (index = pp rank) for schedule `name`."""
    check_schedule_args(name, pp, num_microbatches, v)
    return [list(ops) for ops in _build(name, pp, num_microbatches, v)]
