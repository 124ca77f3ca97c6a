"""Collectives over an uneven split of dim 0: rank i of a group holds sizes[i] rows.

    sizes = split_sizes(21, 2)                       # [11, 10]: the first 21 % 2 ranks take one more row
    full = all_gather(piece, group, sizes)           # [sizes[rank], ...] -> [sum(sizes), ...]
    mine = reduce_scatter(full_partial, group, sizes) # [sum(sizes), ...] -> [sizes[rank], ...], summed

torch's all-gather and reduce-scatter into one tensor take equal pieces, so on the wire every piece is
padded with zeros to the longest (at most one row per rank more than the data) and the padding is dropped
after: one equal collective through `comm` (its ledger counts the padded bytes, which are what travel).
Used where a token count need not divide the group (MoE at etp 1 routes each tp rank's share of any
sequence length: megalite/moe/layer.py).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` rows over `parts` ranks as evenly as they go, the first total % parts ranks one row longer
    (21 over 2: [11, 10]); rank i's rows start at sum(sizes[:i])."""
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} rows over {parts} ranks")
    base, extra = divmod(total, parts)
    return [base + (1 if rank < extra else 0) for rank in range(parts)]


def _check(sizes: list[int], group, total: int, what: str) -> int:
    """The split's longest piece, after checking it is the group's: one size per rank, summing to `total`."""
    n = comm.group_size(group)
    if len(sizes) != n or sum(sizes) != total or min(sizes) < 0:
        raise ValueError(f"{what}: sizes {sizes} are not {n} pieces of {total} rows")
    return max(sizes)


def _padded(piece: torch.Tensor, length: int) -> torch.Tensor:
    """[m, ...] -> [length, ...] (m <= length): zero rows after the piece's."""
    if piece.shape[0] == length:
        return piece
    return torch.cat([piece, piece.new_zeros((length - piece.shape[0],) + tuple(piece.shape[1:]))])


def all_gather(piece: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """[sizes[rank], ...] on each rank -> [sum(sizes), ...], the pieces in rank order."""
    if comm.group_size(group) == 1:
        return piece
    rank = comm.group_rank(group)
    if piece.shape[0] != sizes[rank]:
        raise ValueError(f"all_gather: rank {rank} holds {piece.shape[0]} rows, its piece is {sizes[rank]}")
    longest = _check(sizes, group, sum(sizes), "all_gather")
    output = piece.new_empty((len(sizes) * longest,) + tuple(piece.shape[1:]))  # rank-major, padded
    comm.all_gather_into(output, _padded(piece.contiguous(), longest), group)
    return torch.cat([padded[:size] for padded, size in zip(output.split(longest), sizes)])


def reduce_scatter(full: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """[sum(sizes), ...] partial sums on each rank -> this rank's [sizes[rank], ...] rows, summed over the group."""
    if comm.group_size(group) == 1:
        return full
    longest = _check(sizes, group, full.shape[0], "reduce_scatter")
    padded = torch.cat([_padded(piece, longest) for piece in full.split(sizes)]).contiguous()  # [n * longest, ...]
    output = full.new_empty((longest,) + tuple(full.shape[1:]))
    comm.reduce_scatter_into(output, padded, group)
    return output[:sizes[comm.group_rank(group)]]


def split(full: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """[sum(sizes), ...] -> this rank's [sizes[rank], ...] rows (no communication)."""
    if comm.group_size(group) == 1:
        return full
    _check(sizes, group, full.shape[0], "split")
    return full.split(sizes)[comm.group_rank(group)].contiguous()
