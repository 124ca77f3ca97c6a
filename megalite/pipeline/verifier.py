"""Prove, before running, that a schedule is complete, consistent and cannot deadlock.

`verify_schedule(schedule, pp, v, num_microbatches)` checks:

1. Local dataflow per stage: every (chunk, microbatch) has one FWD and either one BWD or
   one BWD_INPUT followed by one BWD_WEIGHT; a chunk that is not the first model chunk
   receives its activation before its FWD, one that is not the last sends it after; the
   mirror image for gradients; nothing else, nothing twice. Where the neighbour model chunk
   is a local chunk of the same stage (DualPipeV's V placement, p2p.is_local_hop) nothing is
   sent: the FWD needs that chunk's FWD before it, the backward its backward.
2. Communication, by simulating the executor's blocking semantics with the strictest
   (rendezvous) rule: a maximal run of transfer instructions is one batch, posted at once;
   the stage waits until every op of the batch is matched by the peer's posted op. Messages
   between a pair of stages match in posting order, so the k-th send a->b must carry the
   same (activation|gradient, model chunk, microbatch) as the k-th receive posted at b.
   A state where unfinished stages all wait is a deadlock; the error names what each
   stage waits on. Real transports that complete sends eagerly only block less, and the
   outcome does not depend on which stage the simulation advances first.

Raises `ScheduleError` (a ValueError) with a message saying which stage waits on what.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, SEND_KINDS, Instr, Schedule, split_steps)
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk, is_local_hop, peer
from megalite.pipeline.partition import ChunkPlacement, model_chunk_id


class ScheduleError(ValueError):
    pass


def _message(instr: Instr, pp: int, stage: int, placement: ChunkPlacement) -> tuple[str, int, int]:
    """What travels: ('act'|'grad', sending model chunk, microbatch); same on both ends."""
    k = model_chunk_id(pp, stage, instr.chunk, placement)
    if instr.kind == SEND_ACT:
        return "act", k, instr.microbatch
    if instr.kind == RECV_ACT:
        return "act", k - 1, instr.microbatch
    if instr.kind == SEND_GRAD:
        return "grad", k, instr.microbatch
    return "grad", k + 1, instr.microbatch  # RECV_GRAD


def _describe(msg: tuple[str, int, int]) -> str:
    what, k, mb = msg
    return f"{'activation' if what == 'act' else 'gradient'} of model chunk {k} mb {mb}"


@dataclass(frozen=True)
class _Neighbours:
    """Where (stage, chunk)'s neighbour model chunks are: `before` / `after` say whether the
    predecessor / successor is reached by a transfer; `local_before` / `local_after` give the
    local chunk when it sits on the same stage (the V placement's turn), else None."""

    before: bool
    after: bool
    local_before: int | None
    local_after: int | None


def _neighbours(pp: int, v: int, stage: int, chunk: int, placement: ChunkPlacement) -> _Neighbours:
    first, last = is_first_chunk(pp, stage, chunk), is_last_chunk(pp, v, stage, chunk, placement)
    local_before = peer(RECV_ACT, pp, v, stage, chunk, placement)[1] \
        if is_local_hop(RECV_ACT, pp, v, stage, chunk, placement) else None
    local_after = peer(SEND_ACT, pp, v, stage, chunk, placement)[1] \
        if is_local_hop(SEND_ACT, pp, v, stage, chunk, placement) else None
    return _Neighbours(not first and local_before is None, not last and local_after is None, local_before, local_after)


def _check_local(ops: list[Instr], stage: int, pp: int, v: int, m: int, forward_only: bool = False,
                 placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    neighbours = [_neighbours(pp, v, stage, c, placement) for c in range(v)]
    for i, op in enumerate(ops):
        where = f"stage {stage} instruction #{i} {op}"
        if not (0 <= op.chunk < v and 0 <= op.microbatch < m):
            raise ScheduleError(f"{where}: chunk must be in [0, {v}) and microbatch in [0, {m})")
        key = (op.kind, op.chunk, op.microbatch)
        if key in seen:
            raise ScheduleError(f"{where}: duplicate of instruction #{seen[key]}")
        seen[key] = i
        _check_order(op, where, seen, forward_only, neighbours[op.chunk])
    for c, near in enumerate(neighbours):
        for mb in range(m):
            if forward_only:
                required = [FWD] + ([RECV_ACT] if near.before else []) + ([SEND_ACT] if near.after else [])
            else:
                required = [FWD] + ([RECV_ACT, SEND_GRAD] if near.before else []) \
                    + ([SEND_ACT, RECV_GRAD] if near.after else [])
                required += [BWD_INPUT, BWD_WEIGHT] if (BWD_INPUT, c, mb) in seen else [BWD]
            for kind in required:
                if (kind, c, mb) not in seen:
                    raise ScheduleError(f"stage {stage} never runs {Instr(kind, c, mb)}")


def _check_order(op: Instr, where: str, seen: dict, forward_only: bool, near: _Neighbours) -> None:
    """What must precede `op` on its stage (`seen`: the instructions before it)."""
    c, mb = op.chunk, op.microbatch

    def need(kind: str, chunk: int = c) -> None:
        if (kind, chunk, mb) not in seen:
            raise ScheduleError(f"{where}: needs {Instr(kind, chunk, mb)} before it")

    def backward_of(chunk: int) -> bool:
        return (BWD, chunk, mb) in seen or (BWD_INPUT, chunk, mb) in seen

    if forward_only and op.kind not in (FWD, SEND_ACT, RECV_ACT):
        raise ScheduleError(f"{where}: a forward-only schedule runs no backward")
    if op.kind in (RECV_ACT, SEND_GRAD) and not near.before:
        raise ScheduleError(f"{where}: " + ("the first model chunk has no predecessor to talk to"
                                            if near.local_before is None else
                                            "its predecessor is a local chunk of this stage: nothing is sent"))
    if op.kind in (SEND_ACT, RECV_GRAD) and not near.after:
        raise ScheduleError(f"{where}: " + ("the last model chunk has no successor to talk to"
                                            if near.local_after is None else
                                            "its successor is a local chunk of this stage: nothing is sent"))
    if op.kind == FWD and near.before:
        need(RECV_ACT)
    elif op.kind == FWD and near.local_before is not None:
        need(FWD, near.local_before)  # the local hop: the predecessor's output, in memory
    elif op.kind == SEND_ACT:
        need(FWD)
        if backward_of(c):
            raise ScheduleError(f"{where}: must come before the backward of (chunk {c}, mb {mb}), "
                                f"which releases the output")
    elif op.kind in (BWD, BWD_INPUT):
        need(FWD)
        if near.after:
            need(RECV_GRAD)
        elif near.local_after is not None and not backward_of(near.local_after):
            raise ScheduleError(f"{where}: needs the backward of (chunk {near.local_after}, mb {mb}) before it")
        if (BWD if op.kind == BWD_INPUT else BWD_INPUT, c, mb) in seen:
            raise ScheduleError(f"{where}: (chunk {c}, mb {mb}) already has a backward")
    elif op.kind == SEND_GRAD:
        if not backward_of(c):
            raise ScheduleError(f"{where}: needs the backward of (chunk {c}, mb {mb}) before it")
    elif op.kind == BWD_WEIGHT:
        need(BWD_INPUT)
    elif op.kind not in (RECV_ACT, RECV_GRAD, FWD):
        raise ScheduleError(f"{where}: unknown instruction kind")


class _Simulation:
    """Run every stage's steps under rendezvous semantics; optionally repair deadlocks.

    State: each stage's position (step index), the batch it has posted, and per ordered pair
    (sender, receiver) the messages posted so far on each end.
    """

    def __init__(self, schedule: Schedule, pp: int, v: int, placement: ChunkPlacement = ChunkPlacement.INTERLEAVED):
        self.pp, self.v, self.placement = pp, v, placement
        self.steps = [split_steps(list(ops)) for ops in schedule]
        self.offsets = [self._offsets(stage) for stage in range(pp)]
        self.position = [0] * pp
        self.posted: list[list | None] = [None] * pp  # per stage: [(pair, k, is_send)] of its batch
        self.sent: dict[tuple[int, int], list] = defaultdict(list)  # pair -> [(message, stage, instr #)]
        self.received: dict[tuple[int, int], list] = defaultdict(list)

    def schedule(self) -> Schedule:
        return [[op for step in steps for op in step] for steps in self.steps]

    def _offsets(self, stage: int) -> list[int]:
        offsets, total = [], 0
        for step in self.steps[stage]:
            offsets.append(total)
            total += len(step)
        return offsets

    def _index(self, stage: int, step: int, j: int = 0) -> int:
        """Flat instruction index of op j of step `step` (for messages)."""
        return self.offsets[stage][step] + j

    def _post_op(self, stage: int, op: Instr) -> None:
        other = peer(op.kind, self.pp, self.v, stage, op.chunk, self.placement)[0]
        is_send = op.kind in SEND_KINDS
        pair = (stage, other) if is_send else (other, stage)
        queue = self.sent[pair] if is_send else self.received[pair]
        self.posted[stage].append((pair, len(queue), is_send))
        step = self.steps[stage][self.position[stage]]
        queue.append((_message(op, self.pp, stage, self.placement), stage, self._index(stage, self.position[stage], step.index(op))))

    def _waits(self, stage: int) -> list[tuple[int, tuple[int, int], int, bool]]:
        """Unmatched ops of the posted batch as (peer, pair, k, is_send); raises on order mismatch."""
        waits = []
        for pair, k, is_send in self.posted[stage]:
            mine = (self.sent if is_send else self.received)[pair][k]
            other_queue = self.received[pair] if is_send else self.sent[pair]
            if len(other_queue) <= k:
                waits.append((pair[1] if is_send else pair[0], pair, k, is_send))
                continue
            theirs = other_queue[k]
            if theirs[0] != mine[0]:
                snd, rcv = (mine, theirs) if is_send else (theirs, mine)
                a, b = pair
                raise ScheduleError(
                    f"message order mismatch between stage {a} and stage {b}: stage {a}'s send #{k} "
                    f"(instruction #{snd[2]}) carries the {_describe(snd[0])} but stage {b}'s receive #{k} "
                    f"(instruction #{rcv[2]}) expects the {_describe(rcv[0])}")
        return waits

    def run(self, repair: bool = False) -> None:
        while True:
            self._advance()
            stuck = [s for s in range(self.pp) if self.position[s] < len(self.steps[s])]
            if not stuck:
                break
            if not (repair and self._hoist_receive(stuck)):
                self._raise_deadlock(stuck)
        for pair in set(self.sent) | set(self.received):
            if len(self.sent[pair]) != len(self.received[pair]):
                a, b = pair
                raise ScheduleError(f"stage {a} sends {len(self.sent[pair])} messages to stage {b} but stage {b} "
                                    f"receives {len(self.received[pair])}")

    def _advance(self) -> None:
        progress = True
        while progress:
            progress = False
            for stage in range(self.pp):
                while self.position[stage] < len(self.steps[stage]):
                    step = self.steps[stage][self.position[stage]]
                    if step[0].is_transfer:
                        if self.posted[stage] is None:
                            self.posted[stage] = []
                            for op in step:
                                self._post_op(stage, op)
                        if self._waits(stage):
                            break
                        self.posted[stage] = None
                    self.position[stage] += 1
                    progress = True

    def _hoist_receive(self, stuck: list[int]) -> bool:
        """Repair: move the receive that a blocked send needs into the receiver's blocked batch.

        The k-th send a->b waits for b's k-th receive from a, which b has not posted because
        b blocks in an earlier batch; posting it there too keeps the pair's order and lets the
        send complete. Returns False when no stuck stage waits on a send (not repairable).
        """
        for a in stuck:
            for b, pair, k, is_send in self._waits(a):
                if not is_send or b not in stuck:
                    continue
                for step_index in range(self.position[b] + 1, len(self.steps[b])):
                    step = self.steps[b][step_index]
                    for j, op in enumerate(step):
                        if op.is_transfer and op.kind not in SEND_KINDS \
                                and peer(op.kind, self.pp, self.v, b, op.chunk, self.placement)[0] == a:
                            del step[j]
                            if not step:
                                del self.steps[b][step_index]
                            self.steps[b][self.position[b]].append(op)
                            self.offsets[b] = self._offsets(b)
                            self._post_op(b, op)
                            return True
        return False

    def _raise_deadlock(self, stuck: list[int]) -> None:
        lines, waits_on = [], {}
        for s in stuck:
            waits = self._waits(s)
            waits_on[s] = waits[0][0]
            described = []
            for other, pair, k, is_send in waits:
                msg, _, index = (self.sent if is_send else self.received)[pair][k]
                verb = "send to" if is_send else "receive from"
                described.append(f"{verb} stage {other} the {_describe(msg)} (instruction #{index})")
            lines.append(f"stage {s} waits to " + "; and to ".join(described))
        cycle, s = [stuck[0]], waits_on[stuck[0]]
        while s in waits_on and s not in cycle:
            cycle.append(s)
            s = waits_on[s]
        chain = " -> ".join(str(x) for x in cycle + [s])
        raise ScheduleError("deadlock: " + ". ".join(lines) + f" (wait chain: stage {chain})")


def verify_schedule(schedule: Schedule, pp: int, v: int, num_microbatches: int, forward_only: bool = False, *,
                    placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> None:
    """Raise ScheduleError unless `schedule` is complete, consistent and deadlock-free (its model
    chunks placed on the stages by `placement`: `schedules.chunk_placement` of its name)."""
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} stages, expected pp={pp}")
    for stage, ops in enumerate(schedule):
        _check_local(list(ops), stage, pp, v, num_microbatches, forward_only, placement)
    _Simulation(schedule, pp, v, placement).run(repair=False)


def repair_receive_order(schedule: Schedule, pp: int, v: int,
                         placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> Schedule:
    """Post receives early where a send would otherwise wait forever (see _hoist_receive).

    Used by the generators after placing every transfer next to its compute instruction;
    the result is still checked by `verify_schedule`.
    """
    simulation = _Simulation(schedule, pp, v, placement)
    simulation.run(repair=True)
    return simulation.schedule()


def peak_live_microbatches(ops: list[Instr]) -> int:
    """Most (chunk, microbatch) activations alive at once on one stage: FWD .. end of its backward."""
    live, peak = set(), 0
    split = {(op.chunk, op.microbatch) for op in ops if op.kind == BWD_INPUT}
    for op in ops:
        key = (op.chunk, op.microbatch)
        if op.kind == FWD:
            live.add(key)
            peak = max(peak, len(live))
        elif op.kind == BWD_WEIGHT or (op.kind == BWD and key not in split):
            live.discard(key)
    return peak
