"""Where transfers go in a stage's instruction list: from an ideal timeline of the compute.

A transfer batch completes only when every peer has posted its side (see verifier.py), so a
send placed where the receiver is still busy stalls the sender, and a receive posted long
before the data exists stalls the receiver. Placing every receive just before its consumer
is right for 1F1B but costs interleaved 1F1B and ZB-H1 most of their advantage.

So: run the compute order on an ideal clock (F = 1, BWD = 2, BWD_INPUT = BWD_WEIGHT = 1 per
chunk; transfers free; each op starts when its stage is free and its input exists), then put
each message's send and receive into the batches the two stages reach at the same ideal
time T: the earliest time, from the producer's end to the consumer's start, at which neither
stage is inside an op. Both sides then post at T and nobody waits under ideal timing. Messages
between a pair are ordered (T, activation before gradient, model chunk, microbatch) on both
ends, so the k-th send meets the k-th receive. When no common free time exists before the
consumer, the receive goes just before the consumer and the send at the sender's next free
time (a stall, never a wrong match: the verifier re-checks every schedule). A local hop (the
V placement's turn on rank pp-1, p2p.is_local_hop) gets no transfer: the consumer only waits
for its producer on the same stage.
"""
from __future__ import annotations

import bisect

from megalite.pipeline.instructions import (BWD, BWD_INPUT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Instr,
                                            Schedule)
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk, is_local_hop, peer
from megalite.pipeline.partition import ChunkPlacement

IDEAL_COST = {FWD: 1, BWD: 2, BWD_INPUT: 1, "BWD_WEIGHT": 1}


def ideal_timeline(compute: list[list[Instr]], pp: int, v: int,
                   placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute op, ASAP in each stage's order with free transfers."""
    finish: dict[tuple[str, int, int, int], int] = {}  # ("F"|"B", stage, chunk, mb) -> end time
    times: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    free = [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while len(times[r]) < len(compute[r]):
                op = compute[r][len(times[r])]
                ready = 0
                if op.kind == FWD and not is_first_chunk(pp, r, op.chunk):
                    s, c = peer(RECV_ACT, pp, v, r, op.chunk, placement)
                    ready = finish.get(("F", s, c, op.microbatch))
                elif op.kind in (BWD, BWD_INPUT) and not is_last_chunk(pp, v, r, op.chunk, placement):
                    s, c = peer(RECV_GRAD, pp, v, r, op.chunk, placement)
                    ready = finish.get(("B", s, c, op.microbatch))
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + IDEAL_COST[op.kind]
                times[r].append((start, free[r]))
                if op.kind in (FWD, BWD, BWD_INPUT):
                    finish[("F" if op.kind == FWD else "B", r, op.chunk, op.microbatch)] = free[r]
                progress = True
    if any(len(times[r]) < len(compute[r]) for r in range(pp)):
        raise RuntimeError("compute order waits on itself across stages; the schedule generator has a bug")
    return times


class _Clock:
    """One stage's ideal op intervals, sorted (ops of a stage never overlap)."""

    def __init__(self, intervals: list[tuple[int, int]]):
        self.starts = [start for start, _ in intervals]
        self.ends = [end for _, end in intervals]

    def busy(self, t: int) -> bool:
        i = bisect.bisect_left(self.starts, t) - 1  # last op starting before t
        return i >= 0 and self.ends[i] > t

    def position(self, t: int) -> int:
        """Index of the first op starting at or after t (a batch at free time t goes before it)."""
        return bisect.bisect_left(self.starts, t)

    def ends_between(self, low: int, high: int) -> list[int]:
        return self.ends[bisect.bisect_right(self.ends, low):bisect.bisect_left(self.ends, high)]


def place_transfers(compute: list[list[Instr]], pp: int, v: int,
                    placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> Schedule:
    times = ideal_timeline(compute, pp, v, placement)
    clocks = [_Clock(intervals) for intervals in times]
    index = {(r, op.kind, op.chunk, op.microbatch): i for r, ops in enumerate(compute) for i, op in enumerate(ops)}
    batches: list[dict[int, list]] = [dict() for _ in range(pp)]  # stage -> position -> [(key, instr)]

    def add(stage: int, position: int, key: tuple, instr: Instr) -> None:
        batches[stage].setdefault(position, []).append((key, instr))

    for a, ops in enumerate(compute):
        for i, op in enumerate(ops):
            c, mb = op.chunk, op.microbatch
            if op.kind == FWD and not is_last_chunk(pp, v, a, c, placement):
                send, recv, consumer_kinds, order = SEND_ACT, RECV_ACT, (FWD,), 0
            elif op.kind in (BWD, BWD_INPUT) and not is_first_chunk(pp, a, c):
                send, recv, consumer_kinds, order = SEND_GRAD, RECV_GRAD, (BWD, BWD_INPUT), 1
            else:
                continue
            if is_local_hop(send, pp, v, a, c, placement):
                continue
            b, peer_chunk = peer(send, pp, v, a, c, placement)
            j = next(index[(b, k, peer_chunk, mb)] for k in consumer_kinds if (b, k, peer_chunk, mb) in index)
            produced, consumed = times[a][i][1], times[b][j][0]
            candidates = sorted({produced, consumed} | set(clocks[a].ends_between(produced, consumed))
                                | set(clocks[b].ends_between(produced, consumed)))
            common = next((t for t in reversed(candidates) if not clocks[a].busy(t) and not clocks[b].busy(t)), None)
            if common is not None:
                send_time = recv_time = common
            else:  # the receiver stalls until the sender is free
                recv_time = consumed
                send_time = next(t for t in [consumed] + clocks[a].ends_between(consumed - 1, 10**9)
                                 if t >= consumed and not clocks[a].busy(t))
            add(a, clocks[a].position(send_time), (send_time, order, c, a, mb), Instr(send, c, mb))
            add(b, clocks[b].position(recv_time), (recv_time, order, c, a, mb), Instr(recv, peer_chunk, mb))

    schedule = []
    for r, ops in enumerate(compute):
        out: list[Instr] = []
        for position in range(len(ops) + 1):
            out += [instr for _, instr in sorted(batches[r].get(position, []), key=lambda item: item[0])]
            if position < len(ops):
                out.append(ops[position])
        schedule.append(out)
    return schedule
