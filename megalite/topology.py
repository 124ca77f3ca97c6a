"""Rank arithmetic of the (tp, dp, pp) layout: pure functions, no torch, no process group.

Rank order is Megatron's: tp varies fastest, then dp, then pp,

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of one tensor-parallel group are neighbours (one node, NVLink) and pipeline
stages are farthest apart (they only exchange activations point to point). `megalite.mesh`
builds the process groups from these lists; the planner validates layouts with them.
"""
from __future__ import annotations


def validate_layout(world_size: int, tp: int, pp: int, dp: int | None) -> int:
    """Check the degrees against the world size and return dp (inferred when None).

    Raises ValueError naming what to change; never touches a process group.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if dp is None:
        if world_size % (tp * pp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"launch a multiple of {tp * pp} processes or change --tp/--pp"
            )
        return world_size // (tp * pp)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"--dp must be a positive integer, got {dp!r}")
    if tp * pp * dp != world_size:
        raise ValueError(
            f"world size {world_size} != tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}; "
            f"launch {tp * pp * dp} processes (torchrun --nproc_per_node ...) or change --tp/--pp/--dp"
        )
    return dp


def rank_to_coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """rank -> (tp_rank, dp_rank, pp_rank) in Megatron order (tp fastest, then dp, then pp)."""
    if not 0 <= rank < tp * pp * dp:
        raise ValueError(f"rank {rank} outside a world of {tp * pp * dp}")
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def coords_to_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """(tp_rank, dp_rank, pp_rank) -> global rank; inverse of `rank_to_coords`."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def tp_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every tensor-parallel group: ranks that share (dp_rank, pp_rank)."""
    return [[coords_to_rank(t, d, p, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)]


def dp_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every data-parallel group: ranks that share (tp_rank, pp_rank) and hold the same weights."""
    return [[coords_to_rank(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)]


def pp_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every pipeline group: ranks that share (tp_rank, dp_rank), ordered by stage."""
    return [[coords_to_rank(t, d, p, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)]


def model_parallel_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every model-parallel group (tp x pp): the ranks that together hold one model replica."""
    return [sorted(coords_to_rank(t, d, p, tp, dp) for p in range(pp) for t in range(tp)) for d in range(dp)]


def embedding_group_ranks(tp: int, pp: int, dp: int) -> list[list[int]]:
    """First and last pipeline stage of every pipeline group: they share the tied embedding.

    With pp == 1 the group is the single rank (the embedding is tied locally).
    """
    return [[ranks[0]] if pp == 1 else [ranks[0], ranks[-1]] for ranks in pp_group_ranks(tp, pp, dp)]
