"""Box arithmetic: where a piece of a rank's local tensor lives in the full logical tensor.

Everything a checkpoint stores — model weights and the optimizer's fp32 master weights and
moments — is a set of *boxes* of full logical tensors: a box is one (start, stop) interval per
dimension of the full (unpadded) tensor. A box says nothing about the layout that wrote it,
so a reader at any (tp, pp, dp, zero stage) finds what it needs by intersecting boxes.

Two sources of boxes:
- a tp shard: the local tensor maps onto the full tensor through `ShardSpec.pieces()`
  (fused blocks such as [Q; K; V] give several pieces, padding rows give none);
- a flat range of the local tensor (the optimizer's ZeRO ownership, `start..end` of the
  flattened local shard): it may start and end in the middle of a row, so it is cut into at
  most 2 * ndim - 1 row-major boxes first (`flat_range_boxes`), then mapped through the pieces.
"""
from __future__ import annotations

import math

from megalite.parameters.sharding import ShardSpec

Box = tuple[tuple[int, int], ...]


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, size) for size in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of `a` and `b`, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(start < stop for start, stop in out) else None


def relative(inner: Box, outer: Box) -> Box:
    """`inner` in the coordinates of `outer` (inner must lie inside outer)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Cut the flat range [start, end) of a row-major tensor of `shape` into boxes, in order.

    E.g. shape (3, 4), range [2, 9) -> row 0 cols 2..4, row 1 whole, row 2 col 0.
    """
    if start >= end:
        return []
    if len(shape) == 0:
        return [()]
    if len(shape) == 1:
        return [((start, end),)]
    inner = math.prod(shape[1:])
    first_row, first_offset = divmod(start, inner)
    last_row, last_offset = divmod(end, inner)
    if first_row == last_row:  # inside one row
        return [((first_row, first_row + 1),) + b for b in flat_range_boxes(shape[1:], first_offset, last_offset)]
    out: list[Box] = []
    if first_offset:  # the tail of a partial first row
        out += [((first_row, first_row + 1),) + b for b in flat_range_boxes(shape[1:], first_offset, inner)]
        first_row += 1
    if last_row > first_row:  # whole rows
        out.append(((first_row, last_row),) + whole_box(tuple(shape[1:])))
    if last_offset:  # the head of a partial last row
        out += [((last_row, last_row + 1),) + b for b in flat_range_boxes(shape[1:], 0, last_offset)]
    return out


def local_to_full(spec: ShardSpec, local_box: Box) -> list[tuple[Box, Box]]:
    """[(local sub-box, full box)] for a box of the local tensor; padding rows are dropped."""
    if len(local_box) == 0:
        return [((), ())]
    if spec.dim is None:
        return [(local_box, local_box)]
    dim = spec.dim
    lo, hi = local_box[dim]
    out = []
    for local_start, full_start, length in spec.pieces():
        start, stop = max(lo, local_start), min(hi, local_start + length)
        if start >= stop:
            continue
        local_sub = local_box[:dim] + ((start, stop),) + local_box[dim + 1:]
        shift = full_start - local_start
        full_sub = local_box[:dim] + ((start + shift, stop + shift),) + local_box[dim + 1:]
        out.append((local_sub, full_sub))
    return out


def shard_boxes(spec: ShardSpec, local_shape: tuple[int, ...], start: int = 0,
                end: int | None = None) -> list[tuple[Box, Box]]:
    """[(local box, full box)] covering the flat range [start, end) of the local tensor."""
    end = math.prod(local_shape) if end is None else end
    return [pair for local_box in flat_range_boxes(tuple(local_shape), start, end)
            for pair in local_to_full(spec, local_box)]
