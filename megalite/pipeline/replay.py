"""The pipeline bubble of a schedule, replayed with measured compute times (pure arithmetic).

Waiting time measured on the host (`run_pipeline`'s "transfer_wait_s") mixes the schedule's
bubble with transfer costs and with a neighbour being descheduled on a busy machine. The
schedule's own bubble is a property of (schedule, pp, v, m) and of how long each stage's
forward and backward take: replay the instruction lists with each stage's measured median
durations, every compute instruction starting when its stage is free and its input is ready
(FWD of model chunk k after FWD of k-1 on that microbatch; a backward after the backward of
k+1), transfers taken as free. Then

    bubble = 1 - (busy seconds of all stages) / (pp * makespan)

the idle share of the pipeline's time; 1F1B with equal stages gives (pp-1)/(m+pp-1).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD, Schedule
from megalite.pipeline.partition import model_chunk_id


def replay_bubble(schedule: Schedule, pp: int, v: int, durations: Sequence[Mapping[str, float]]) -> float:
    """Idle fraction of the pipeline for `schedule` (a verified one: it cannot deadlock) when stage
    s spends durations[s][kind] seconds per compute instruction of that kind (FWD, BWD, ...)."""
    last_chunk = pp * v - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F"|"B", model chunk, microbatch) -> end time
    ops = [[op for op in stage if not op.is_transfer] for stage in schedule]
    clock, cursor = [0.0] * pp, [0] * pp
    busy = 0.0
    while any(cursor[s] < len(ops[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(ops[s]):
                op = ops[s][cursor[s]]
                k = model_chunk_id(pp, s, op.chunk)
                if op.kind == FWD:
                    need = ("F", k - 1, op.microbatch) if k > 0 else None
                elif op.kind in (BWD, BWD_INPUT):
                    need = ("B", k + 1, op.microbatch) if k < last_chunk else None
                else:  # BWD_WEIGHT follows its own B on the same stage
                    need = None
                if need is not None and need not in done:
                    break
                start = max(clock[s], done[need] if need is not None else 0.0)
                clock[s] = start + durations[s].get(op.kind, 0.0)
                busy += durations[s].get(op.kind, 0.0)
                if op.kind != BWD_WEIGHT:
                    done[("F" if op.kind == FWD else "B", k, op.microbatch)] = clock[s]
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("schedule cannot be replayed: a stage waits on a result no stage produces")
    makespan = max(clock)
    return 1.0 - busy / (pp * makespan) if makespan > 0 else 0.0
