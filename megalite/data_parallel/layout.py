"""Where every parameter lives in the flat gradient/parameter buffers, and who owns what.

Parameters are laid out back to back in one flat index space, in the order the engine is
given them (reverse order of use, so that during backward the buffer fills from its start).
The space is cut into buckets of about `bucket_size` elements; a parameter never straddles
two buckets, and a parameter bigger than `bucket_size` gets a bucket of its own.

Each bucket is padded to a multiple of `shard_count` (dp for ZeRO, 1 otherwise) and split
into `shard_count` equal contiguous chunks: shard rank r owns chunk r of every bucket. A
rank's *shard* (its fp32 master weights, Adam moments and reduced gradients) is the
concatenation of its chunks, bucket by bucket:

    flat buffer  | bucket 0: [c0 | c1]   | bucket 1: [c0 | c1]   |      (shard_count = 2)
    shard of r=1 | bucket 0's c1 | bucket 1's c1 |

so one reduce-scatter per bucket leaves every rank exactly the gradients of the elements
it updates, and one all-gather per bucket brings the updated parameters back.

Parameters may belong to different replica groups (`kinds`: 0 the dense parameters, replicated
over dp x cp; 1 the experts, replicated over the expert-data-parallel group). A bucket holds one
kind only and is cut into that kind's `shard_counts[kind]` chunks; a rank's shard rank is then one
per kind (`owned_pieces((dense rank, expert rank))`).
This module is pure index arithmetic: no tensors, no communication.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place: [start, end) in the flat buffer, inside bucket `bucket`."""

    start: int
    end: int
    bucket: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    """[start, end) in the flat buffer (padded: numel % shard_count == 0) and its parameters."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]
    shard_count: int
    shard_offset: int
    """Where this bucket's chunk begins inside every rank's shard."""
    kind: int = 0
    """The replica group of its parameters (0 dense, 1 experts): the group it reduces and gathers over."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.shard_count

    def owned(self, shard_rank: int) -> tuple[int, int]:
        """[start, end) in the flat buffer of the chunk `shard_rank` owns."""
        start = self.start + shard_rank * self.chunk_numel
        return start, start + self.chunk_numel


@dataclass(frozen=True)
class OwnedPiece:
    """The part of one parameter a rank owns.

    `local_start:local_end` indexes the parameter's flattened local tensor (its tp shard,
    `param.reshape(-1)`); `shard_start` is where that piece begins in the rank's shard.
    """

    param: int
    local_start: int
    local_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.local_end - self.local_start

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.numel


@dataclass(frozen=True)
class BufferLayout:
    slots: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    numel: int
    """Total padded size of the flat buffer."""
    shard_count: int

    @property
    def shard_numel(self) -> int:
        """Size of every rank's shard (numel / shard_count with one kind of parameter)."""
        return sum(b.chunk_numel for b in self.buckets)

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (numel minus padding)."""
        return sum(s.numel for s in self.slots)

    def owned_pieces(self, shard_rank: int | tuple[int, ...]) -> list[OwnedPiece]:
        """Every non-empty piece of a parameter that `shard_rank` owns, in shard order (one rank per
        kind of parameter when the layout has several)."""
        ranks = (shard_rank,) if isinstance(shard_rank, int) else tuple(shard_rank)
        pieces = []
        for bucket in self.buckets:
            own_start, own_end = bucket.owned(ranks[bucket.kind])
            for index in bucket.params:
                slot = self.slots[index]
                lo, hi = max(slot.start, own_start), min(slot.end, own_end)
                if lo < hi:
                    pieces.append(OwnedPiece(index, lo - slot.start, hi - slot.start,
                                             bucket.shard_offset + lo - own_start))
        return pieces


def build_layout(numels: list[int], bucket_size: int, shard_count: int,
                 alone: frozenset[int] = frozenset(), kinds: list[int] | None = None,
                 kind_shard_counts: tuple[int, ...] = (), tags: list[int] | None = None) -> BufferLayout:
    """Lay out parameters of the given sizes (in this order) into padded buckets.

    `alone`: indices of parameters that must sit in a bucket of their own (e.g. the tied
    embedding under pipeline parallelism, whose reduction must wait for the embedding
    all-reduce). `kinds`: each parameter's replica group (default all 0); a bucket never mixes
    kinds, and kind j > 0 is cut into `kind_shard_counts[j - 1]` chunks (kind 0: `shard_count`).
    `tags`: neighbours with different tags never share a bucket (streaming DiLoCo's fragments, synced
    and published apart: data_parallel/diloco.py).
    """
    kinds = kinds or [0] * len(numels)
    tags = tags or [0] * len(numels)
    counts = (shard_count,) + tuple(kind_shard_counts)
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size}")
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index, numel in enumerate(numels):
        if current and (kinds[index], tags[index]) != (kinds[current[-1]], tags[current[-1]]):  # one kind, one tag
            groups.append(current)
            current, current_numel = [], 0
        if index in alone:
            if current:
                groups.append(current)
            groups.append([index])
            current, current_numel = [], 0
            continue
        current.append(index)
        current_numel += numel
        if current_numel >= bucket_size:
            groups.append(current)
            current, current_numel = [], 0
    if current:
        groups.append(current)
    return _place(numels, groups, shard_count, [counts[kinds[g[0]]] for g in groups], [kinds[g[0]] for g in groups])


def build_unit_layout(unit_numels: list[list[int]], shard_count: int, kinds: list[int] | None = None,
                      kind_shard_counts: tuple[int, ...] = ()) -> BufferLayout:
    """ZeRO-3: one bucket per unit (`unit_numels[u]`: its parameters' sizes, in order).

    Parameters are numbered across units in order; unit u is bucket u, padded to a multiple of
    `shard_count`, so rank r's shard holds chunk r of every unit. `kinds[u]` > 0 (an expert
    unit) is cut into `kind_shard_counts[kind - 1]` chunks instead.
    """
    kinds = kinds or [0] * len(unit_numels)
    counts = (shard_count,) + tuple(kind_shard_counts)
    if shard_count < 1:
        raise ValueError(f"shard_count must be >= 1, got {shard_count}")
    numels = [n for unit in unit_numels for n in unit]
    groups, start = [], 0
    for unit in unit_numels:
        groups.append(list(range(start, start + len(unit))))
        start += len(unit)
    return _place(numels, groups, shard_count, [counts[k] for k in kinds], kinds)


def _place(numels: list[int], groups: list[list[int]], shard_count: int, group_counts: list[int] | None = None,
           group_kinds: list[int] | None = None) -> BufferLayout:
    """Parameters `groups[b]` back to back in bucket b, each bucket padded to a multiple of its shard
    count (`group_counts[b]`, default `shard_count`)."""
    slots: list[ParamSlot | None] = [None] * len(numels)
    buckets = []
    offset = shard_offset = 0
    for bucket_index, members in enumerate(groups):
        start = offset
        for index in members:
            slots[index] = ParamSlot(offset, offset + numels[index], bucket_index)
            offset += numels[index]
        used = offset - start
        count = group_counts[bucket_index] if group_counts else shard_count
        padded = -(-max(used, 1) // count) * count
        offset = start + padded
        buckets.append(Bucket(bucket_index, start, offset, tuple(members), count, shard_offset,
                              group_kinds[bucket_index] if group_kinds else 0))
        shard_offset += padded // count
    return BufferLayout(tuple(slots), tuple(buckets), offset, shard_count)
