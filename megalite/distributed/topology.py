"""Rank arithmetic of the (tp, cp, dp, pp) layout: pure functions, no torch, no process group.

Rank order is Megatron's, with context parallelism between tp and dp: tp varies fastest,
then cp, then dp, then pp,

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the ranks of one tensor-parallel group are neighbours (one node, NVLink), a context-parallel
ring is next closest (it moves K/V blocks every layer), and pipeline stages are farthest apart
(they only exchange activations point to point). At cp = 1 this is `tp_rank + tp * (dp_rank +
dp * pp_rank)`: every layout without context parallelism keeps its ranks.

Parameters are replicated across cp (each cp rank holds different tokens of the same
sequences), so gradients are reduced over the combined data x context group, `dp_cp`.
`megalite.distributed.mesh` builds the process groups from these lists, for sizes a `megalite.layout.Layout`
has validated (the rules between the sizes live there, not here).
"""
from __future__ import annotations


def rank_to_coords(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """rank -> (tp_rank, dp_rank, pp_rank) in Megatron order (tp fastest, then cp, dp, pp).

    The cp coordinate is `rank_to_cp_rank` (kept apart so the 3-tuple stays what every
    caller without context parallelism unpacks).
    """
    if not 0 <= rank < tp * cp * pp * dp:
        raise ValueError(f"rank {rank} outside a world of {tp * cp * pp * dp}")
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def rank_to_cp_rank(rank: int, tp: int, cp: int) -> int:
    """rank -> cp_rank: the position of `rank` in its context-parallel ring."""
    return (rank // tp) % cp


def coords_to_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0,
                   cp: int = 1) -> int:
    """(tp_rank, dp_rank, pp_rank[, cp_rank]) -> global rank; inverse of `rank_to_coords`."""
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))


def _ranks(tp: int, pp: int, dp: int, cp: int, vary: str) -> list[list[int]]:
    """Every group whose members share all coordinates but those named in `vary` (of "tcdp").

    Members are listed with the varied coordinates nested in mesh order (the slowest named
    first), groups in mesh order of the fixed coordinates: ascending ranks for contiguous
    coordinates, stage order for pp.
    """
    sizes = {"t": tp, "c": cp, "d": dp, "p": pp}
    fixed = [a for a in "pdct" if a not in vary]  # slowest first
    varied = [a for a in "pdct" if a in vary]
    groups = []
    for fixed_values in _product([sizes[a] for a in fixed]):
        members = []
        for varied_values in _product([sizes[a] for a in varied]):
            at = dict(zip(fixed, fixed_values), **dict(zip(varied, varied_values)))
            members.append(coords_to_rank(at["t"], at["d"], at["p"], tp, dp, at["c"], cp))
        groups.append(members)
    return groups


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    """All index tuples over `sizes`, the last varying fastest."""
    out: list[tuple[int, ...]] = [()]
    for size in sizes:
        out = [prefix + (i,) for prefix in out for i in range(size)]
    return out


def tp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every tensor-parallel group: ranks that share (cp_rank, dp_rank, pp_rank)."""
    return _ranks(tp, pp, dp, cp, "t")


def cp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every context-parallel ring: ranks that share (tp_rank, dp_rank, pp_rank), by cp_rank.

    Its members hold different pieces of the same sequences and the same weights.
    """
    return _ranks(tp, pp, dp, cp, "c")


def dp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every data-parallel group: ranks that share (tp_rank, cp_rank, pp_rank) and hold the same weights."""
    return _ranks(tp, pp, dp, cp, "d")


def dp_cp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every data x context group: ranks that share (tp_rank, pp_rank), in ascending rank order.

    Parameters are replicated over it, so gradients are reduced (and ZeRO shards laid out)
    over it. At cp = 1 it is the data-parallel group.
    """
    return _ranks(tp, pp, dp, cp, "dc")


def pp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every pipeline group: ranks that share (tp_rank, cp_rank, dp_rank), ordered by stage."""
    return _ranks(tp, pp, dp, cp, "p")


def model_parallel_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every model-parallel group (tp x pp): the ranks that together hold one model replica.

    One per (cp_rank, dp_rank): cp ranks hold replicas too (of the weights, not of the tokens).
    """
    return [sorted(g) for g in _ranks(tp, pp, dp, cp, "pt")]


def embedding_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """First and last pipeline stage of every pipeline group: they share the tied embedding.

    With pp == 1 the group is the single rank (the embedding is tied locally).
    """
    return [[ranks[0]] if pp == 1 else [ranks[0], ranks[-1]] for ranks in pp_group_ranks(tp, pp, dp, cp)]


# ---------------------------------------------------------------------------------------------
# Expert parallelism: ep subdivides dp x cp (Megatron-core's folding)
# ---------------------------------------------------------------------------------------------


def ep_group_ranks(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> list[list[int]]:
    """Every expert-parallel group: `ep` consecutive members of a dp x cp group (ascending ranks).

    Its members hold different experts of the same layers and exchange tokens (all-to-all). ep divides
    dp*cp (megalite.layout checks it)."""
    return [members[i:i + ep] for members in dp_cp_group_ranks(tp, pp, dp, cp) for i in range(0, dp * cp, ep)]


def expert_dp_group_ranks(tp: int, pp: int, dp: int, cp: int, ep: int, etp: int) -> list[list[int]]:
    """Every expert-data-parallel group: the ranks of one pipeline stage holding the same experts.

    etp = tp: the dp*cp/ep members of a dp x cp group with the same ep rank (one group per tp rank,
    each holding its own slices). etp = 1 (tp > 1): whole experts on every tp rank, so those members of
    every tp rank together (tp*dp*cp/ep ranks, ascending). Expert gradients reduce (and ZeRO shards
    them) over it. The sizes are a valid `megalite.layout.Layout`'s."""
    groups = [members[i::ep] for members in dp_cp_group_ranks(tp, pp, dp, cp) for i in range(ep)]
    if etp == tp:
        return groups
    per_tp = len(groups) // (pp * tp)  # groups per (stage, tp rank): one per ep rank
    merged = []
    for stage in range(pp):
        for i in range(per_tp):
            merged.append(sorted(r for t in range(tp) for r in groups[(stage * tp + t) * per_tp + i]))
    return merged


def tp_cp_group_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[list[int]]:
    """Every tp x cp group: ranks sharing (dp_rank, pp_rank), ascending. With whole experts (etp = 1)
    its members route different tokens of the same sequences: the router's losses are theirs together."""
    return _ranks(tp, pp, dp, cp, "ct")


# ---------------------------------------------------------------------------------------------
# Hybrid sharding: dp = dp_shard x dp_replicate (torchtitan's dp_shard / dp_replicate, Megatron's
# --num-distributed-optimizer-instances = dp_replicate). ZeRO shards over S = dp_shard consecutive
# dp ranks (x cp, as flat ZeRO shards over dp x cp) and replicates across the dp / S groups:
#
#     dp_rank = shard_index + S * replica_index        (the shard index varies fastest)
#
# so a shard group's ranks are neighbours (a node, a rack) and only the replicas' all-reduce
# crosses the far links. Experts split the same way: ep must divide S*cp, so every ep group lies
# inside one shard group and a replica group holds whole copies of every expert (megalite.layout's rule).
# ---------------------------------------------------------------------------------------------


def _replica_index(rank: int, tp: int, pp: int, dp: int, cp: int, dp_shard: int) -> int:
    return rank_to_coords(rank, tp, pp, dp, cp)[1] // dp_shard


def _split_by_replica(groups: list[list[int]], tp: int, pp: int, dp: int, cp: int, dp_shard: int) -> list[list[int]]:
    """Each group cut into its members of one replica index (order kept; groups in replica order)."""
    out = []
    for members in groups:
        for replica in range(dp // dp_shard):
            part = [r for r in members if _replica_index(r, tp, pp, dp, cp, dp_shard) == replica]
            if part:
                out.append(part)
    return out


def dp_shard_group_ranks(tp: int, pp: int, dp: int, cp: int = 1, dp_shard: int | None = None) -> list[list[int]]:
    """Every ZeRO shard group: the dp x cp members of one (tp_rank, pp_rank) with dp ranks
    [k*S, (k+1)*S), ascending. At S = dp (the default) it is the dp x cp group."""
    dp_shard = dp if dp_shard is None else dp_shard
    return _split_by_replica(dp_cp_group_ranks(tp, pp, dp, cp), tp, pp, dp, cp, dp_shard)


def dp_replicate_group_ranks(tp: int, pp: int, dp: int, cp: int = 1, dp_shard: int | None = None
                             ) -> list[list[int]]:
    """Every replica group: the ranks that hold the same shard (same tp, cp, pp rank and dp_rank % S),
    by replica index; dp / S members each."""
    dp_shard = dp if dp_shard is None else dp_shard
    span = dp_shard * cp  # members of one shard group inside a dp x cp group
    return [members[q::span] for members in dp_cp_group_ranks(tp, pp, dp, cp) for q in range(span)]


def expert_dp_shard_group_ranks(tp: int, pp: int, dp: int, cp: int, ep: int, etp: int,
                                dp_shard: int | None = None) -> list[list[int]]:
    """Every expert shard group: the expert-dp members of one replica index (order kept). The experts'
    replicas across shard groups are the dense replica groups' ranks (`dp_replicate_group_ranks`)."""
    dp_shard = dp if dp_shard is None else dp_shard  # a valid size: megalite.layout.Layout checked it
    return _split_by_replica(expert_dp_group_ranks(tp, pp, dp, cp, ep, etp), tp, pp, dp, cp, dp_shard)
