"""DualPipe's F&B overlap, replayed: a DualPipeV step whose F&B pairs each run as one unit (pure arithmetic).

DualPipe (DeepSeek-V3 report, section 3.2.1) runs the forward of one chunk and the backward of the
other as one overlapped unit ("F&B"): the two computations share the device while each one's
communication (the MoE all-to-alls, the pipeline transfers) hides behind the other's compute.
`schedules.dualpipev_overlap_pairs` names those pairs; megalite's executor runs each pair's two
instructions one after the other (docs/architecture/pipeline.md: what overlapping them would take).

This replay is the published schedule's clock: a pair starts when its stage is free and both of
its instructions' inputs are ready, and takes `pair_cost` seconds. With F = B = W per chunk and
F&B = F + B its bubble is the published (pp-1)(F&B + B - 3W) per rank exactly
(tests/pipeline/test_dualpipev.py); run one after the other (megalite's executor), the forward of
a pair need not wait for its backward's gradient, and the bubble is half of that.
"""
from __future__ import annotations

from typing import Mapping

from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD, Instr
from megalite.pipeline.partition import ChunkPlacement, model_chunk_id
from megalite.pipeline.schedules import dualpipev_compute, dualpipev_overlap_pairs


def _units(ops: list[Instr], pairs: list[tuple[Instr, ...]]) -> list[tuple[Instr, ...]]:
    """The stage's compute as units: an overlapped F&B pair (FWD, BWD_INPUT, BWD_WEIGHT), or one instruction."""
    starts = {pair[0]: pair for pair in pairs}
    units, i = [], 0
    while i < len(ops):
        pair = starts.get(ops[i])
        if pair is not None and tuple(ops[i:i + len(pair)]) == pair:
            units.append(pair)
            i += len(pair)
        else:
            units.append((ops[i],))
            i += 1
    return units


def _result(op: Instr, pp: int, stage: int) -> tuple[str, int, int]:
    return ("F" if op.kind == FWD else "B", model_chunk_id(pp, stage, op.chunk, ChunkPlacement.V), op.microbatch)


def _needs(op: Instr, pp: int, stage: int) -> tuple[str, int, int] | None:
    """The result (pass, model chunk, microbatch) `op` waits for; None: nothing off its own stage's order."""
    kind, k, mb = _result(op, pp, stage)
    if op.kind == FWD:
        return ("F", k - 1, mb) if k > 0 else None
    if op.kind in (BWD, BWD_INPUT):
        return ("B", k + 1, mb) if k < 2 * pp - 1 else None
    return None


def dualpipev_makespan(pp: int, m: int, cost: Mapping[str, float], pair_cost: float | None = None) -> float:
    """Seconds of one DualPipeV step with `cost[kind]` seconds per chunk instruction (FWD, BWD, BWD_INPUT,
    BWD_WEIGHT; transfers free) and each F&B pair taking `pair_cost` as one unit (None: its two
    instructions one after the other, as megalite's executor runs them)."""
    compute = [dualpipev_compute(pp, m, r) for r in range(pp)]
    pairs = dualpipev_overlap_pairs(pp, m) if pair_cost is not None else [[]] * pp
    units = [_units(ops, pairs[r]) for r, ops in enumerate(compute)]
    done: dict[tuple[str, int, int], float] = {}
    clock, cursor = [0.0] * pp, [0] * pp
    while any(cursor[s] < len(units[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while cursor[s] < len(units[s]):
                unit = units[s][cursor[s]]
                needs = [n for n in (_needs(op, pp, s) for op in unit) if n is not None]
                if any(n not in done for n in needs):
                    break
                start = max([clock[s]] + [done[n] for n in needs])
                clock[s] = start + (pair_cost if len(unit) > 1 else cost[unit[0].kind])
                for op in unit:
                    if op.kind != BWD_WEIGHT:
                        done[_result(op, pp, s)] = clock[s]
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("DualPipeV's order waits on itself; the schedule generator has a bug")
    return max(clock)


def dualpipev_idle(pp: int, m: int, cost: Mapping[str, float], pair_cost: float | None = None) -> float:
    """Idle seconds of every rank in one step (the makespan less a rank's work, the same on every rank:
    each runs m forwards and backwards of its two chunks, with the same number of F&B pairs)."""
    pairs = len(dualpipev_overlap_pairs(pp, m)[0]) if pair_cost is not None else 0
    work = 2 * m * (cost[FWD] + cost[BWD_INPUT] + cost[BWD_WEIGHT])
    work += pairs * (pair_cost - cost[FWD] - cost[BWD_INPUT] - cost[BWD_WEIGHT]) if pair_cost is not None else 0
    return dualpipev_makespan(pp, m, cost, pair_cost) - work
