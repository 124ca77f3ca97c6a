"""Muon in the planner: Newton-Schulz FLOPs and the owner assignment that spreads them.

Muon (megalite/optim/muon.py) orthogonalises each logical matrix whole, once, on one owner rank
(ARCHITECTURE.md decision 15). Which rank owns which matrix is this module's pure function
`assign_owners`: it sees only costs and candidate ranks, so the optimizer, the planner and a test
all get the same answer, and `describe_owners` prints it.

Newton-Schulz on an [A, B] matrix (Keller Jordan's quintic iteration, as torch.optim.Muon runs it):
with m = min(A, B), n = max(A, B), X is [m, n] and each of the `steps` iterations is

    G = X X^T           2 m^2 n   FLOPs   (the Gram matrix, [m, m])
    H = b G + c G G     2 m^3
    X = a X + H X       2 m^2 n

so 4 m^2 n + 2 m^3 per iteration (`ns_flops`). Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from megalite.config.choices import MuonOwners


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` Newton-Schulz iterations on a [rows, cols] matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs: Sequence[float], candidates: Sequence[Sequence[tuple[Hashable, ...]]], *,
                  policy: MuonOwners = MuonOwners.BALANCED,
                  start: dict[Hashable, float] | None = None) -> list[int]:
    """For each matrix i, the index of its owner in `candidates[i]`.

    candidates[i]: the choices for matrix i, each a tuple of the ranks that would all compute it (one
    rank normally; every tp rank of a replica when a matrix is whole on each of them). `start`: load
    already on some ranks (FLOPs). Policies:
      BALANCED    largest cost first, to the choice whose busiest rank is least loaded (Graham's LPT:
                  within 4/3 of the best makespan); ties go to the earlier choice;
      ROUND_ROBIN matrix i to choice i mod len(choices), in the order given;
      FIRST       every matrix to its first choice (one rank does all the work: a test's extreme).
    Deterministic: every rank that calls it with the same arguments gets the same list.
    """
    if len(costs) != len(candidates):
        raise ValueError(f"{len(costs)} costs for {len(candidates)} candidate lists")
    if policy == MuonOwners.FIRST:
        return [0] * len(costs)
    if policy == MuonOwners.ROUND_ROBIN:
        return [i % len(choices) for i, choices in enumerate(candidates)]
    load: dict[Hashable, float] = dict(start or {})
    chosen = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        best = min(range(len(candidates[i])),
                   key=lambda c: (max(load.get(r, 0.0) for r in candidates[i][c]), c))
        chosen[i] = best
        for rank in candidates[i][best]:
            load[rank] = load.get(rank, 0.0) + costs[i]
    return chosen


def owner_loads(costs: Sequence[float], candidates: Sequence[Sequence[tuple[Hashable, ...]]],
                chosen: Sequence[int]) -> dict[Hashable, float]:
    """FLOPs per rank under an assignment."""
    load: dict[Hashable, float] = {}
    for cost, choices, c in zip(costs, candidates, chosen):
        for rank in choices[c]:
            load[rank] = load.get(rank, 0.0) + cost
    return load


def describe_owners(names: Sequence[str], costs: Sequence[float],
                    candidates: Sequence[Sequence[tuple[Hashable, ...]]], chosen: Sequence[int]) -> str:
    """The assignment as text: one line per matrix (name, owner ranks, GFLOP), then the load per rank."""
    lines = [f"{name}: rank {','.join(map(str, choices[c]))} ({cost / 1e9:.3f} GFLOP)"
             for name, cost, choices, c in zip(names, costs, candidates, chosen)]
    load = owner_loads(costs, candidates, chosen)
    lines.append("load: " + ", ".join(f"rank {r} {load[r] / 1e9:.3f}" for r in sorted(load, key=str)) + " GFLOP")
    return "\n".join(lines)
