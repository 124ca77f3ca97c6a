"""A pipeline schedule laid out in time: which stage runs what, when (pure arithmetic).

    blocks = schedule_timeline(verified_schedule("1f1b", pp=4, num_microbatches=8), pp=4, v=1)
    print(text_timeline(blocks, pp=4))       # --print-schedule: one row per stage
    # tools/plot_schedule.py draws the same blocks (stages x time, bubble shaded)

The replay is replay.py's: each compute instruction starts when its stage is free and its input is
ready (the forward of model chunk k after the forward of k-1 on that microbatch, a backward after
the backward of k+1), with per-stage seconds per instruction kind (1 each by default: the ideal
schedule). Transfers cost nothing in this replay; each is recorded at the moment its stage posts it,
so a picture can mark sends and receives without stretching the compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, Schedule)
from megalite.pipeline.partition import ChunkPlacement, model_chunk_id

LETTER = {FWD: "F", BWD: "B", BWD_INPUT: "b", BWD_WEIGHT: "w", SEND_ACT: ">a", RECV_ACT: "<a", SEND_GRAD: ">g",
          RECV_GRAD: "<g"}
EQUAL = {FWD: 1.0, BWD: 2.0, BWD_INPUT: 1.0, BWD_WEIGHT: 1.0}  # a backward is two forwards; B + W is one BWD


@dataclass(frozen=True)
class Block:
    """One instruction of one stage in time; a transfer's start == end (the moment it is posted)."""

    stage: int
    kind: str
    chunk: int  # local chunk on the stage
    microbatch: int
    start: float
    end: float

    @property
    def is_transfer(self) -> bool:
        return self.kind in (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)


def _needs(kind: str, k: int, microbatch: int, last_chunk: int) -> tuple[str, int, int] | None:
    """The result an instruction of model chunk k waits for (None: its inputs are on its stage)."""
    if kind == FWD:
        return ("F", k - 1, microbatch) if k > 0 else None
    if kind in (BWD, BWD_INPUT):
        return ("B", k + 1, microbatch) if k < last_chunk else None
    return None  # BWD_WEIGHT follows its own B on the same stage


def schedule_timeline(schedule: Schedule, pp: int, v: int, durations: Sequence[Mapping[str, float]] | None = None,
                      *, placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> list[Block]:
    """Every instruction of a verified schedule as a Block; `durations[stage][kind]` seconds per compute
    instruction (default EQUAL on every stage); `placement`: the schedule's (schedules.chunk_placement).
    ValueError if a stage waits on what none produces."""
    durations = durations or [EQUAL] * pp
    last_chunk = pp * v - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F"|"B", model chunk, microbatch) -> end time
    clock, cursor, blocks = [0.0] * pp, [0] * pp, []
    while any(cursor[s] < len(schedule[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(schedule[s]):
                op = schedule[s][cursor[s]]
                if op.is_transfer:
                    blocks.append(Block(s, op.kind, op.chunk, op.microbatch, clock[s], clock[s]))
                    cursor[s] += 1
                    continue
                k = model_chunk_id(pp, s, op.chunk, placement)
                need = _needs(op.kind, k, op.microbatch, last_chunk)
                if need is not None and need not in done:
                    break
                start = max(clock[s], done[need] if need is not None else 0.0)
                clock[s] = start + durations[s].get(op.kind, 0.0)
                blocks.append(Block(s, op.kind, op.chunk, op.microbatch, start, clock[s]))
                if op.kind != BWD_WEIGHT:
                    done[("F" if op.kind == FWD else "B", k, op.microbatch)] = clock[s]
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("schedule cannot be replayed: a stage waits on a result no stage produces")
    return blocks


def bubble_of(blocks: list[Block], pp: int) -> float:
    """1 - busy / (pp * makespan): the idle share of the pipeline's time."""
    compute = [b for b in blocks if not b.is_transfer]
    makespan = max((b.end for b in compute), default=0.0)
    busy = sum(b.end - b.start for b in compute)
    return 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0


def text_timeline(blocks: list[Block], pp: int) -> str:
    """One row per stage, one cell per time unit (the shortest compute instruction; as wide as the
    longest label), each instruction as its letter, chunk and microbatch (F0.3: forward of chunk 0
    on microbatch 3), idle time as dots; a last line gives the bubble."""
    compute = [b for b in blocks if not b.is_transfer]
    width = 1 + max(len(f"{LETTER[b.kind]}{b.chunk}.{b.microbatch}") for b in compute)
    unit = min(b.end - b.start for b in compute if b.end > b.start)
    cells = round(max(b.end for b in compute) / unit)
    rows = []
    for stage in range(pp):
        row = ["." * (width - 1) + " "] * cells
        for b in (b for b in compute if b.stage == stage):
            first, count = round(b.start / unit), max(1, round((b.end - b.start) / unit))
            label = f"{LETTER[b.kind]}{b.chunk}.{b.microbatch}"
            text = label.ljust(count * width - 1)[:count * width - 1] + " "
            for i in range(count):
                row[first + i] = text[i * width:(i + 1) * width]
        rows.append(f"stage {stage}: " + "".join(row).rstrip())
    rows.append(f"bubble {bubble_of(blocks, pp):.1%} (F=forward, B=backward, b=input grad, w=weight grad; "
                f"chunk.microbatch; dots: idle)")
    return "\n".join(rows)
