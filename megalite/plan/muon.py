"""Muon in the planner: Newton-Schulz FLOPs and the owner assignment that spreads them.

Muon (megalite/optim/muon.py) orthogonalises each logical matrix whole, once, on one owner rank
(the blueprint's decision 15). Which rank owns which matrix is this module's pure function
`assign_owners`: it sees only costs and candidate ranks, so the optimizer, the planner and a test
all get the same answer, and `describe_owners` prints it.

Newton-Schulz on an [A, B] matrix (Keller Jordan's quintic iteration, as torch.optim.Muon runs it):
with m = min(A, B), n = max(A, B), X is [m, n] and each of the `steps` iterations is

    G = X X^T           2 m^2 n   FLOPs   (the Gram matrix, [m, m])
    H = b G + c G G     2 m^3
    X = a X + H X       2 m^2 n

so 4 m^2 n + 2 m^3 per iteration (`ns_flops`).

What Muon adds to a rank of a pipeline stage (state, the exchange's bytes, the FLOPs over the owners)
is plan/muon_stage.py's `stage_muon`; each rank's own share, plan/muon_ranks.py's.
Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from megalite.config.choices import MuonOwners


NOT_HIDDEN = ("embedding", "output_weight", "lm_head", "router", "position", "shared_expert_gate")


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """Muon's share by default: 2-D weights that are not an embedding, the output layer or a router (the one
    rule: optim/muon.py's `default_hidden_matrix` and the planner's parameter list both ask it)."""
    return ndim == 2 and not any(word in name for word in NOT_HIDDEN)


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` Newton-Schulz iterations on a [rows, cols] matrix (module docstring)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs: Sequence[float], candidates: Sequence[Sequence[tuple[Hashable, ...]]], *,
                  policy: MuonOwners = MuonOwners.BALANCED,
                  start: dict[Hashable, float] | None = None, sizes: Sequence[float] | None = None,
                  homes: Sequence[Sequence[tuple[Hashable, ...]]] | None = None,
                  start_bytes: dict[Hashable, float] | None = None) -> list[int]:
    """For each matrix i, the index of its owner in `candidates[i]`.

    candidates[i]: the choices for matrix i, each a tuple of the ranks that would all compute it (one
    rank normally; every tp rank of a replica when a matrix is whole on each of them). `start`: load
    already on some ranks (FLOPs). `homes[i][c]`: the ranks that receive matrix i's `sizes[i]` elements
    in the ZeRO hop under choice c (`start_bytes`: elements already there). Policies:
      BALANCED    largest cost first, to the choice whose busiest rank is least loaded (Graham's LPT:
                  within 4/3 of the best makespan); among those, the one whose most loaded home has the
                  fewest elements (else the first ZeRO member would receive every large matrix: at
                  llama-70b's tp 8 x dp 16, the 8 gate/up weights of a stage, 940 MB in bf16, where the
                  mean is 134 MB); then the earlier choice;
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
    held: dict[Hashable, float] = dict(start_bytes or {})
    chosen = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        def key(c: int, i: int = i) -> tuple:
            received = max((held.get(r, 0.0) for r in homes[i][c]), default=0.0) if homes else 0.0
            return max(load.get(r, 0.0) for r in candidates[i][c]), received, c
        best = min(range(len(candidates[i])), key=key)
        chosen[i] = best
        for rank in candidates[i][best]:
            load[rank] = load.get(rank, 0.0) + costs[i]
        for rank in homes[i][best] if homes else ():
            held[rank] = held.get(rank, 0.0) + sizes[i]
    return chosen


def assign_in_two_passes(costs: Sequence[float], candidates: Sequence[Sequence[tuple[Hashable, ...]]], *,
                         expert: Sequence[bool], policy: MuonOwners = MuonOwners.BALANCED,
                         sizes: Sequence[float], homes: Sequence[Sequence[tuple[Hashable, ...]]]) -> list[int]:
    """`assign_owners` for the dense matrices, then for the experts starting from the dense loads (FLOPs
    and home elements). In two passes because ranks of other ep ranks hold other experts: a joint pass
    would let their experts move the dense owners apart (every rank of the stage must agree on those)."""
    chosen, start, start_bytes = [0] * len(costs), None, None
    for experts in (False, True):
        part = [k for k in range(len(costs)) if bool(expert[k]) == experts]
        picked = assign_owners([costs[k] for k in part], [candidates[k] for k in part], policy=policy, start=start,
                               sizes=[sizes[k] for k in part], homes=[homes[k] for k in part],
                               start_bytes=start_bytes)
        for k, c in zip(part, picked):
            chosen[k] = c
        start = owner_loads([costs[k] for k in part], [candidates[k] for k in part], picked)
        start_bytes = owner_loads([sizes[k] for k in part], [homes[k] for k in part], picked)
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


def ns_seconds(hw, flops: float, ns_dtype: str = "bf16") -> float:
    """Seconds of `flops` of Newton-Schulz GEMMs on profile `hw` (HardwareProfile), at the matmul curve of
    one square GEMM of that work (the iteration's GEMMs are [m, m] and [m, n] products)."""
    if flops <= 0:
        return 0.0
    side = (flops / 2) ** (1 / 3)
    return hw.matmul_seconds(side, side, side, ns_dtype)
