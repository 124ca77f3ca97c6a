"""Muon rank by rank: what the owner assignment gives each rank of a stage to receive, send and hold.

plan/muon_stage.py counts Muon's state, mean bytes and FLOPs per stage. The whole-matrix exchange is not even over the
ranks: a matrix is gathered whole on the one rank that owns it (megalite/data_parallel/whole_matrices.py),
so a rank's all-to-all bytes and the optimizer step's working memory depend on which matrices it owns.
This module runs the optimizer's own assignment (`assign_in_two_passes`, the same pure function) over the
same candidates, built from the layout's rank arithmetic (megalite/distributed/topology.py) where
megalite/optim/muon.py builds them from its process groups, and counts, for one global rank:

    Z        tp-local elements of the matrices it owns in the ZeRO hop (it receives them whole)
    Z_split  the part of Z split over tp (what it sends in the tp hop)
    F_split  full elements of the tp-split matrices it assembles (the tp hop's receipt)
    whole    the matrices it runs Newton-Schulz on, in the optimizer's order (parameter index)

and from those the step's all-to-all bytes and the exchange's peak working set (`muon_step_bytes`).
A rank's own shard's Muon elements (what its ZeRO hop sends first) and its shard's size are its bucket
chunks' (plan/muon_shards.py; at ZeRO 3 its units' chunks). The matrices are taken in the wrapper's order
(plan/param_list.py's `wrapper_order`: the buffer's, or ZeRO 3's units'), as the optimizer's assignment breaks
ties by it. Pure arithmetic, no torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.choices import OptimizerKind, Precision
from megalite.config.model import GPTConfig
from megalite.plan.layout import is_hybrid, zero_group_name
from megalite.plan.moe import experts_apart
from megalite.plan.muon import assign_in_two_passes, ns_flops
from megalite.plan.muon_shards import shard_counts, shard_group, stage_first_rank
from megalite.plan.param_list import PlannedParam, wrapper_order

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter of a stage: its blocks' [rows, cols] (each orthogonalised alone), split over tp?"""

    blocks: tuple[tuple[int, int], ...]
    split: bool
    expert: bool
    tp: int

    @property
    def full(self) -> int:
        return sum(r * c for r, c in self.blocks)

    @property
    def local(self) -> int:
        """Elements one rank holds (its tp shard, or all of it)."""
        return self.full // self.tp if self.split else self.full

    def cost(self, steps: int) -> int:
        return sum(ns_flops(r, c, steps) for r, c in self.blocks)

    def ns_elements(self) -> int:
        """Newton-Schulz's largest working set: X, the next X, X X^T and the polynomial (2mn + 2m^2)."""
        return max(2 * min(r, c) * max(r, c) + 2 * min(r, c) ** 2 for r, c in self.blocks)


def stage_matrices(cfg: RunConfig, params: list[PlannedParam]) -> list[Matrix]:
    """The Muon parameters of a stage's list (plan/param_list.py) in the optimizer's order (the wrapper's:
    `wrapper_order`)."""
    return [Matrix(p.matrices(), p.split, p.expert, cfg.parallel.tp) for p in params if p.hidden]


@dataclass(frozen=True)
class RankShare:
    """What the assignment gives one rank (module docstring); elements, not bytes."""

    zero_owned: dict[bool, int]
    """Z by kind (True: experts in their own replica group)."""
    zero_split: int
    full_split: int
    whole: tuple[Matrix, ...]
    shard_muon: dict[bool, int]
    """Muon elements of this rank's shard by kind (its bucket chunks': plan/muon_shards.py)."""
    hops: dict[bool, str]
    """The ledger's group name of each kind's ZeRO hop (kinds with one shard: none)."""
    shard_total: int
    """Every element of this rank's shard (a shard-sized tensor's)."""


def _candidates(tp: int, rank: int, *, split: bool, members: list[int]) -> list[tuple]:
    """megalite/optim/muon.py's `_candidates` for `rank`, its shard group of the matrix's kind `members`
    (`split`: the matrix is split over tp): (FLOP ranks, (zero member, tp owner), home) per choice."""
    tp_rank, base = rank % tp, rank - rank % tp
    spans_tp = len(members) > 1 and set(range(base, base + tp)) <= set(members)
    out = []
    for d, member in enumerate(members):
        tp_ranks = tuple(member - tp_rank + t for t in range(tp))
        if split:
            out += [((member - tp_rank + t,), (member, t), tp_ranks) for t in range(tp)]
        elif spans_tp or tp == 1:
            out.append(((member,), (member, None), (member,)))
        else:
            out.append((tp_ranks, (member, None), tp_ranks))
    return out


def stage_shares(model: GPTConfig, cfg: RunConfig, stage: int, *, viewpoint: int) -> dict[int, RankShare]:
    """The assignment as global rank `viewpoint` of `stage` computes it, and what it gives every rank it
    names (every rank of the stage agrees on it: the candidates are global ranks; ZeRO 0: the viewpoint's
    tp group, other dp replicas alike): a rank owns a matrix in the ZeRO hop where it is one of the chosen
    home's ranks, and runs Newton-Schulz on it where it is one of the chosen FLOP ranks."""
    params = wrapper_order(model, cfg, stage)
    matrices = stage_matrices(cfg, params)
    apart = experts_apart(model, cfg)
    groups = {kind: shard_group(cfg, viewpoint, expert=kind) for kind in ((False, True) if apart else (False,))}
    base = stage_first_rank(cfg, stage)  # every stage's ranks are base + [0, tp cp dp): one assignment per shape
    picked = _assignment(cfg.parallel.tp, viewpoint - base, matrices=tuple(matrices), steps=cfg.optimizer.muon_ns_steps,
                         dense=tuple(r - base for r in groups[False]),
                         experts=tuple(r - base for r in groups[True]) if apart else None)
    zero: dict[int, dict[bool, int]] = {}
    zero_split: dict[int, int] = {}
    full_split: dict[int, int] = {}
    whole: dict[int, list[Matrix]] = {}
    for m, (ranks, home) in zip(matrices, picked):
        ranks, home = [r + base for r in ranks], [r + base for r in home]
        for r in home:
            zero.setdefault(r, {False: 0, True: 0})[m.expert and apart] += m.local
            zero_split[r] = zero_split.get(r, 0) + (m.local if m.split else 0)
        for r in ranks:
            whole.setdefault(r, []).append(m)
            full_split[r] = full_split.get(r, 0) + (m.full if m.split else 0)
    hops = {kind: ("edp_shard" if is_hybrid(cfg) else "edp") if kind else zero_group_name(cfg)
            for kind, group in groups.items() if len(group) > 1}
    counts = shard_counts(model, cfg, stage, ranks=set(zero) | set(whole) | {viewpoint}, params=params)
    return {r: RankShare(zero.get(r, {False: 0, True: 0}), zero_split.get(r, 0), full_split.get(r, 0),
                         tuple(whole.get(r, ())), c.muon, hops, c.total) for r, c in counts.items()}


@functools.lru_cache(maxsize=64)
def _assignment(tp: int, viewpoint: int, *, matrices: tuple[Matrix, ...], steps: int, dense: tuple[int, ...],
                experts: tuple[int, ...] | None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(FLOP ranks, home) each matrix is given by `assign_in_two_passes` over the candidates of the
    `viewpoint` rank with shard groups `dense` and `experts` (None: with the dense ones), in ranks from
    the stage's first; remembered, since the stages of a model mostly repeat one shape (the estimate and
    --suggest ask for every stage of many layouts). Candidate lists are built once per kind and split."""
    lists: dict[tuple[bool, bool], list] = {}
    candidates = []
    for m in matrices:
        kind = (m.expert and experts is not None, m.split)
        if kind not in lists:
            lists[kind] = _candidates(tp, viewpoint, split=m.split, members=list(experts if kind[0] else dense))
        candidates.append(lists[kind])
    chosen = assign_in_two_passes([m.cost(steps) for m in matrices],
                                  [[c[0] for c in choices] for choices in candidates],
                                  expert=[m.expert for m in matrices], sizes=[m.local for m in matrices],
                                  homes=[[c[2] for c in choices] for choices in candidates])
    return [(choices[c][0], choices[c][2]) for choices, c in zip(candidates, chosen)]


def rank_share(model: GPTConfig, cfg: RunConfig, stage: int, *, rank: int) -> RankShare:
    """What the assignment gives global `rank` of `stage`."""
    return stage_shares(model, cfg, stage, viewpoint=rank)[rank]


def wire_bytes(cfg: RunConfig) -> int:
    """Bytes of an element on the exchange's wire (and of Newton-Schulz's working set)."""
    return 4 if cfg.optimizer.muon_ns_dtype == Precision.FP32 else 2


def muon_rank_comm(cfg: RunConfig, share: RankShare) -> dict[str, int]:
    """The exchange's all-to-all bytes a rank sends (the ledger's count): each ZeRO hop its shard's Muon
    pieces out and its owned matrices' pieces back; the tp hop its owned tp-local tensors out and its
    assembled matrices' slices back."""
    w, out = wire_bytes(cfg), {}
    for kind, group in share.hops.items():
        out[f"{group}/all_to_all"] = out.get(f"{group}/all_to_all", 0) + w * (share.shard_muon[kind]
                                                                              + share.zero_owned[kind])
    if cfg.parallel.tp > 1 and share.zero_split:
        out["tp/all_to_all"] = w * (share.zero_split + share.full_split)
    return out


def muon_step_bytes(cfg: RunConfig, share: RankShare) -> int:
    """The exchange's peak working set on a rank, beyond the parameters, gradients and optimizer state:
    the Nesterov input (shard-sized), the owned tp-local tensors, what each all-to-all sends and receives,
    and on the owner the assembled matrix, its result and Newton-Schulz's working set
    (WholeMatrices.apply's phases, in order)."""
    w = wire_bytes(cfg)
    values, held = share.shard_total, sum(share.zero_owned.values())
    phases = [values + held + max((share.shard_muon[k] + share.zero_owned[k] for k in share.hops), default=0)]
    phases.append(values + held + share.zero_split + share.full_split)  # tp gather
    received, done = share.full_split, 0
    splits = sum(1 for m in share.whole if m.split)
    for m in share.whole:  # Newton-Schulz, matrix by matrix; the tp receipt freed with its last view
        splits -= m.split
        assembled = m.full if m.split else 0
        phases.append(values + held + (received if splits else 0) + done + assembled + m.full + m.ns_elements())
        done += m.full
    unsplit = sum(m.full for m in share.whole if not m.split)
    phases.append(values + unsplit + 2 * share.full_split + share.zero_split)  # tp scatter
    phases.append(values + share.zero_split + unsplit + values
                  + max((share.zero_owned[k] + share.shard_muon[k] for k in share.hops), default=0))  # ZeRO scatter
    return w * max(phases)


def muon_rank_terms(model: GPTConfig, cfg: RunConfig, stage: int, *, rank: int | None = None) -> tuple[dict, int]:
    """(the exchange's all-to-all bytes by ledger key, the optimizer step's working set in bytes) of global
    `rank` of `stage`; rank None: the stage's busiest rank's working set, the bytes of the stage's first rank.
    ({}, 0) without Muon."""
    if cfg.optimizer.optimizer != OptimizerKind.MUON:
        return {}, 0
    viewpoint = stage_first_rank(cfg, stage) if rank is None else rank
    shares = stage_shares(model, cfg, stage, viewpoint=viewpoint)
    mine = shares[viewpoint]
    working = (muon_step_bytes(cfg, mine) if rank is not None
               else max(muon_step_bytes(cfg, share) for share in shares.values()))
    return muon_rank_comm(cfg, mine), working
