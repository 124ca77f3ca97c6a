"""A rank's own Muon and AdamW elements: the wrapper's bucket chunks, rebuilt from the stage's parameters.

At ZeRO 1 and 2 a rank updates one chunk of every bucket of the flat gradient buffer
(megalite/data_parallel/layout.py). Which parameters' elements fall in its chunks decides its optimizer
state (Muon keeps one fp32 buffer, AdamW two: optim/compact_state.py) and what its ZeRO hop sends (its
shard's Muon pieces, megalite/data_parallel/whole_matrices.py). The planner lays the stage's parameters
out with the wrapper's own function (`build_layout`, over plan/param_list.py's list: the same sizes,
order, kinds and tied buckets as grad_buffers.GradBuffers) and reads each rank's chunks
(`BufferLayout.owned_pieces`), so each rank's counts are its own, not the stage's mean (M/S).

ZeRO 3 lays the units out instead, one bucket each (`build_unit_layout`, over plan/param_list.py's
`stage_unit_params`: GPTModel.zero3_units' members, order and kinds, the tied embedding split off at pp > 1):
a rank updates chunk i of every unit, so its counts are read the same way. Pure arithmetic, no torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from megalite.config.model import GPTConfig
from megalite.data_parallel.layout import BufferLayout, build_layout, build_unit_layout
from megalite.distributed import topology
from megalite.plan.moe import experts_apart
from megalite.plan.param_list import PlannedParam, stage_param_list, stage_unit_params

if TYPE_CHECKING:
    from megalite.config import RunConfig


def shard_group(cfg: RunConfig, rank: int, *, expert: bool) -> list[int]:
    """The group the rank's ZeRO shards of a kind lie over (its own rank alone at ZeRO 0)."""
    p = cfg.parallel
    if not p.zero:
        return [rank]
    groups = _all_shard_groups(p.tp, p.pp, dp=cfg.dp, cp=p.cp, ep=p.ep, etp=cfg.etp_size, dp_shard=cfg.dp_shard,
                               expert=expert)
    return next(g for g in groups if rank in g)


def shard_place(cfg: RunConfig, rank: int, *, expert: bool) -> tuple[int, int]:
    """(the rank's index in its ZeRO shard group of a kind, the group's size); (0, 1) at ZeRO 0."""
    p = cfg.parallel
    if not p.zero:
        return 0, 1
    return _shard_places(p.tp, p.pp, dp=cfg.dp, cp=p.cp, ep=p.ep, etp=cfg.etp_size, dp_shard=cfg.dp_shard,
                         expert=expert)[rank]


@functools.lru_cache(maxsize=16)
def _shard_places(tp: int, pp: int, *, dp: int, cp: int, ep: int, etp: int, dp_shard: int,
                  expert: bool) -> dict[int, tuple[int, int]]:
    groups = _all_shard_groups(tp, pp, dp=dp, cp=cp, ep=ep, etp=etp, dp_shard=dp_shard, expert=expert)
    return {r: (i, len(g)) for g in groups for i, r in enumerate(g)}


@functools.lru_cache(maxsize=16)
def _all_shard_groups(tp: int, pp: int, *, dp: int, cp: int, ep: int, etp: int, dp_shard: int,
                      expert: bool) -> tuple[list[int], ...]:
    """Every ZeRO shard group of the world (the mesh's lists), once per layout."""
    if expert:
        return tuple(topology.expert_dp_shard_group_ranks(tp, pp, dp, cp, ep, etp, dp_shard))
    return tuple(topology.dp_shard_group_ranks(tp, pp, dp, cp, dp_shard))


def stage_layout(model: GPTConfig, cfg: RunConfig, stage: int, *, params: list[PlannedParam] | None = None
                 ) -> tuple[list[PlannedParam], BufferLayout, tuple[tuple[int, ...], ...]]:
    """The stage's parameters in buffer order, their layout as grad_buffers.GradBuffers builds it
    (ZeRO 0-2: kind 1 the experts when they have a replica group of their own, the tied embedding in a
    bucket of its own at pp > 1, each kind cut into its shard group's size, 1 at ZeRO 0), and the Muon
    elements of each shard index's chunks by kind. `params`: the stage's list, where the caller has it."""
    params = params if params is not None else stage_param_list(model, cfg, stage)
    apart, first = experts_apart(model, cfg), stage_first_rank(cfg, stage)
    counts = (shard_place(cfg, first, expert=False)[1], shard_place(cfg, first, expert=True)[1] if apart else 1)
    alone = tuple(i for i, p in enumerate(params) if p.tied) if cfg.parallel.pp > 1 else ()
    layout, muon = _layout(tuple(p.numel for p in params), cfg.parallel.ddp_bucket_size, counts, alone,
                           tuple(int(apart and p.expert) for p in params),
                           tuple(p.hidden for p in params))
    return params, layout, muon


@functools.lru_cache(maxsize=64)
def _layout(numels: tuple[int, ...], bucket_size: int, counts: tuple[int, int], alone: tuple[int, ...],
            kinds: tuple[int, ...], hidden: tuple[bool, ...]) -> tuple[BufferLayout, tuple[tuple[int, ...], ...]]:
    """`build_layout`, and muon[kind][i]: the Muon elements shard index i of that kind owns; remembered, since
    the stages of a model mostly repeat one shape (--suggest asks for every stage of many layouts)."""
    layout = build_layout(list(numels), bucket_size, counts[0], frozenset(alone), list(kinds), (counts[1],))
    return layout, _muon_by_shard(layout, counts, hidden)


@functools.lru_cache(maxsize=64)
def _unit_layout(units: tuple[tuple[int, ...], ...], counts: tuple[int, int], kinds: tuple[int, ...],
                 hidden: tuple[bool, ...]) -> tuple[BufferLayout, tuple[tuple[int, ...], ...]]:
    """ZeRO 3's `build_unit_layout` (units' sizes, each unit's kind), and muon[kind][i] as `_layout`'s."""
    layout = build_unit_layout([list(u) for u in units], counts[0], list(kinds), (counts[1],))
    return layout, _muon_by_shard(layout, counts, hidden)


def _muon_by_shard(layout: BufferLayout, counts: tuple[int, int], hidden: tuple[bool, ...]) -> tuple[tuple[int, ...], ...]:
    """muon[kind][i]: the Muon elements (`hidden[param]`) of the chunks shard index i of that kind owns."""
    muon = [[0] * counts[0], [0] * counts[1]]
    for i in range(max(counts)):
        for piece in layout.owned_pieces((min(i, counts[0] - 1), min(i, counts[1] - 1))):
            kind = layout.buckets[layout.slots[piece.param].bucket].kind
            if hidden[piece.param] and i < counts[kind]:
                muon[kind][i] += piece.numel
    return tuple(muon[0]), tuple(muon[1])


@dataclass(frozen=True)
class ShardCounts:
    """Elements of one rank's shard."""

    muon: dict[bool, int]
    """Muon's, by kind (True: experts in a replica group of their own)."""
    total: int
    """Every element of the shard, the buckets' padding included (a shard-sized tensor's)."""


def shard_counts(model: GPTConfig, cfg: RunConfig, stage: int, *, ranks: Iterable[int],
                 params: list[PlannedParam] | None = None) -> dict[int, ShardCounts]:
    """The Muon elements and the size of the shard of each global rank of `stage` in `ranks` (module
    docstring); `params`: the stage's list, where the caller has it (ZeRO 0-2)."""
    apart, out = experts_apart(model, cfg), {}
    if cfg.parallel.zero == 3:  # expert units shard over expert-dp whether or not they have replicas apart
        layout, muon = _stage_unit_layout(model, cfg, stage)
        for rank in ranks:
            dense, expert = shard_place(cfg, rank, expert=False)[0], shard_place(cfg, rank, expert=True)[0]
            mine = {False: muon[0][dense], True: muon[1][expert]}
            out[rank] = ShardCounts(mine if apart else {False: mine[False] + mine[True], True: 0}, layout.shard_numel)
        return out
    _, layout, muon = stage_layout(model, cfg, stage, params=params)
    for rank in ranks:
        dense, expert = shard_place(cfg, rank, expert=False)[0], shard_place(cfg, rank, expert=True)[0] if apart else 0
        out[rank] = ShardCounts({False: muon[0][dense], True: muon[1][expert]}, layout.shard_numel)
    return out


def _stage_unit_layout(model: GPTConfig, cfg: RunConfig, stage: int
                       ) -> tuple[BufferLayout, tuple[tuple[int, ...], ...]]:
    """ZeRO 3: the stage's units laid out as the wrapper lays them (`_unit_layout`)."""
    units, first = stage_unit_params(model, cfg, stage), stage_first_rank(cfg, stage)
    counts = (shard_place(cfg, first, expert=False)[1], shard_place(cfg, first, expert=True)[1])
    return _unit_layout(tuple(tuple(p.numel for p in params) for params, _ in units), counts,
                        tuple(kind for _, kind in units), tuple(p.hidden for params, _ in units for p in params))


def muon_state_saved(model: GPTConfig, cfg: RunConfig, stage: int, *, rank: int | None = None) -> int:
    """Bytes of AdamW's second moment that global `rank`'s Muon elements do not keep (one fp32 each); rank
    None: the stage's first rank's."""
    rank = stage_first_rank(cfg, stage) if rank is None else rank
    return 4 * sum(shard_counts(model, cfg, stage, ranks=(rank,))[rank].muon.values())


def stage_first_rank(cfg: RunConfig, stage: int) -> int:
    """The global rank of (tp 0, cp 0, dp 0) of `stage`."""
    return topology.coords_to_rank(0, 0, stage, cfg.parallel.tp, cfg.dp, 0, cfg.parallel.cp)
