"""Which transformer layers each pipeline rank builds (pure arithmetic, no process group).

Vocabulary:
- pp ranks (stages), each holding v *local chunks* (v = virtual stages, v=1 is plain PP).
- pp*v *model chunks* in model order, placed on ranks one of two ways (`ChunkPlacement`):
  INTERLEAVED (Megatron's, every schedule but DualPipeV): local chunk c on rank r is model
  chunk c*pp + r, so rank 0 holds model chunks 0, pp, 2pp, ...; V (DualPipeV, v = 2): rank r
  holds model chunks r (local 0) and 2pp-1-r (local 1), so the model runs down the ranks and
  back up: rank 0 holds the first and the last model chunk, rank pp-1 the two middle ones.
- The first model chunk (rank 0, chunk 0) also holds the embedding, the last model chunk
  (rank pp-1, chunk v-1; under V rank 0, chunk 1) the final norm and the head; they may be
  given fewer blocks.

Three ways to say how many layers each model chunk gets (layer ids are consecutive in model
order):
1. default: num_layers / (pp*v) each; must divide.
2. `first` / `last` (--decoder-first-stage-layers / --decoder-last-stage-layers): the first
   and/or last model chunk get exactly that many blocks (0 allowed: embedding or head only);
   the remaining layers split evenly over the other chunks (must divide, at least 1 each).
3. `layout`: explicit counts per model chunk, "4,6,6,4" (pp*v entries, summing to num_layers;
   only the first and last entry may be 0).
"""
from __future__ import annotations

import enum
from typing import Sequence


class ChunkPlacement(enum.Enum):
    """Which model chunks a pipeline rank holds (see the module docstring); set by the schedule
    (`schedules.chunk_placement`)."""

    INTERLEAVED = "interleaved"  # local chunk c on rank r: model chunk c*pp + r
    V = "v"                      # rank r: model chunks r and 2pp-1-r (v = 2)


def model_chunk_id(pp: int, pp_rank: int, chunk: int, placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> int:
    """Model-order index of local chunk `chunk` on rank `pp_rank` under `placement`."""
    if placement == ChunkPlacement.V:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def chunk_location(pp: int, model_chunk: int,
                   placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> tuple[int, int]:
    """(pp rank, local chunk) holding model chunk `model_chunk`: model_chunk_id's inverse."""
    if placement == ChunkPlacement.V:
        return (model_chunk, 0) if model_chunk < pp else (2 * pp - 1 - model_chunk, 1)
    return model_chunk % pp, model_chunk // pp


def parse_layout(layout: str | Sequence[int]) -> list[int]:
    """'4,6,6,4' or [4, 6, 6, 4] -> [4, 6, 6, 4] (layers per model chunk, model order)."""
    if isinstance(layout, str):
        try:
            counts = [int(part) for part in layout.replace(" ", "").split(",") if part != ""]
        except ValueError:
            raise ValueError(f"pipeline layout {layout!r} must be comma-separated layer counts, e.g. '3,5,5,3'") \
                from None
    else:
        counts = [int(c) for c in layout]
    if any(c < 0 for c in counts):
        raise ValueError(f"pipeline layout {counts} has a negative layer count")
    return counts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def chunk_layer_counts(num_layers: int, pp: int, v: int = 1, first: int | None = None, last: int | None = None,
                       layout: str | Sequence[int] | None = None) -> list[int]:
    """Number of transformer layers of every model chunk, in model order (len pp*v).

    Raises ValueError naming the fix when the layers cannot be split as asked.
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("virtual stages v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    chunks = pp * v
    if layout is not None:
        if first is not None or last is not None:
            raise ValueError("give either a pipeline layout or first/last stage layers, not both")
        counts = parse_layout(layout)
        if len(counts) != chunks:
            raise ValueError(f"pipeline layout {counts} has {len(counts)} entries; it needs pp*v = {pp}*{v} = "
                             f"{chunks} (one per model chunk, in model order)")
        if sum(counts) != num_layers:
            raise ValueError(f"pipeline layout {counts} sums to {sum(counts)} layers; the model has {num_layers}")
        if any(c == 0 for c in counts[1:-1]):
            raise ValueError(f"pipeline layout {counts}: only the first and last model chunk may have 0 layers")
        return counts

    if first is None and last is None:
        if chunks > num_layers:
            raise ValueError(f"num_layers={num_layers} cannot fill pp*v = {pp}*{v} = {chunks} pipeline chunks "
                             f"(each needs at least one layer); lower --pp or --virtual-stages")
        if num_layers % chunks != 0:
            raise ValueError(f"num_layers={num_layers} is not divisible by pp*v = {pp}*{v} = {chunks}; choose pp*v "
                             f"in {_divisors(num_layers)}, or give --decoder-first-stage-layers / "
                             f"--decoder-last-stage-layers or a --pipeline-layout")
        return [num_layers // chunks] * chunks

    if chunks < 2:
        raise ValueError("first/last stage layers need at least two pipeline chunks (pp*v >= 2)")
    for name, value in (("first stage layers", first), ("last stage layers", last)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    fixed = (first or 0) + (last or 0)
    middle_chunks = chunks - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (middle_chunks == 0 and rest != 0):
        raise ValueError(f"first={first} and last={last} stage layers do not fit num_layers={num_layers} "
                         f"over {chunks} pipeline chunks")
    if middle_chunks > 0 and (rest < middle_chunks or rest % middle_chunks != 0):
        raise ValueError(f"after first={first} and last={last} stage layers, {rest} layers remain for "
                         f"{middle_chunks} pipeline chunks, which needs a positive multiple of {middle_chunks}; "
                         f"adjust --decoder-first-stage-layers / --decoder-last-stage-layers")
    each = rest // middle_chunks if middle_chunks else 0
    counts = [each] * chunks
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(num_layers: int, pp: int, v: int, pp_rank: int, first: int | None = None,
                 last: int | None = None, layout: str | Sequence[int] | None = None, *,
                 placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> list[range]:
    """Global layer ids of each local chunk of rank `pp_rank`: one range per chunk (len v).

    Local chunk c is model chunk c*pp + pp_rank (Megatron's interleaved assignment), or under
    the V placement (DualPipeV) model chunks pp_rank and 2pp-1-pp_rank.
    """
    counts = chunk_layer_counts(num_layers, pp, v, first, last, layout)
    if placement == ChunkPlacement.V and v != 2:
        raise ValueError(f"the V placement (dualpipev) holds two model chunks per rank, not v={v}; set --virtual-stages 2")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} outside a pipeline of {pp} stages")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ids = [model_chunk_id(pp, pp_rank, c, placement) for c in range(v)]
    return [range(starts[i], starts[i] + counts[i]) for i in ids]
