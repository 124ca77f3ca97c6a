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

from megalite.pipeline.instructions import Schedule
from megalite.pipeline.partition import ChunkPlacement
from megalite.pipeline.timeline import bubble_of, schedule_timeline


def replay_bubble(schedule: Schedule, pp: int, v: int, durations: Sequence[Mapping[str, float]], *,
                  placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> float:
    """Idle fraction of the pipeline for `schedule` (a verified one: it cannot deadlock) when stage
    s spends durations[s][kind] seconds per compute instruction of that kind (FWD, BWD, ...).
    The replay itself is timeline.schedule_timeline's (the same blocks tools/plot_schedule.py draws)."""
    return bubble_of(schedule_timeline(schedule, pp, v, durations, placement=placement), pp)
