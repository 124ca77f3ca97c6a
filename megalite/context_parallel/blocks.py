"""Which attention blocks a ring step computes, and how much causal work each rank does.

The sequence is cut into 2*cp chunks (see zigzag.py). Under causal attention the block
(query chunk a, key/value chunk b) is

    full      a > b   every query sees every key: plain (non-causal) attention
    diagonal  a == b  causal inside the block
    skipped   a < b   every key is in the future: nothing to compute

At ring step t, cp rank i holds the K/V of rank (i - t) mod cp (K/V move one rank forward
per step). `step_calls` turns the blocks of one step into as few attention calls as possible,
each over contiguous local chunks, so the per-block kernel runs on long rows.
`rank_block_counts` counts the blocks a rank computes over the whole ring: equal on every
rank under the zigzag split, which is the point of it.

With packed documents (or a sliding window) a full block whose queries share no document (or
window) with its keys is skipped too: `visible(q_chunk, kv_chunk)` (context_parallel/documents.py)
says which full blocks hold a visible pair. A diagonal block always does (each token sees itself).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megalite.context_parallel.zigzag import chunk_ids

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def block_kind(q_chunk: int, kv_chunk: int) -> str:
    """full, diagonal or skip for a (query chunk, key/value chunk) pair under causal attention."""
    if q_chunk > kv_chunk:
        return FULL
    return DIAGONAL if q_chunk == kv_chunk else SKIP


def ring_source(cp_rank: int, step: int, cp: int) -> int:
    """The cp rank whose K/V `cp_rank` holds at ring step `step`."""
    return (cp_rank - step) % cp


@dataclass(frozen=True)
class BlockCall:
    """One attention call: local query chunks [q_start, q_stop) against held K/V chunks [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool

    def work(self) -> float:
        """Score elements computed, in units of chunk x chunk (a causal square counts half)."""
        area = (self.q_stop - self.q_start) * (self.kv_stop - self.kv_start)
        return area / 2 if self.causal else float(area)


Visible = Callable[[int, int], bool]  # (query chunk, K/V chunk) -> does any query see any key of it


def _kind(q_chunk: int, kv_chunk: int, visible: Visible | None) -> str:
    kind = block_kind(q_chunk, kv_chunk)
    return SKIP if kind == FULL and visible is not None and not visible(q_chunk, kv_chunk) else kind


def step_calls(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...], *,
               visible: Visible | None = None) -> list[BlockCall]:
    """The attention calls that cover every non-skipped block of local queries vs held K/V.

    A step with diagonal blocks is a rank's own K/V (each chunk lives on one rank): one causal
    call over all its chunks, exact because positions increase along the local sequence (one
    causal call per diagonal block when a full block between them is skipped).
    Otherwise every computed block is full: query chunks that see the same contiguous run of
    K/V chunks share one non-causal call. visible: which full blocks packed documents keep.
    """
    kinds = [[_kind(a, b, visible) for b in kv_chunks] for a in q_chunks]
    if any(DIAGONAL in row for row in kinds):
        if tuple(q_chunks) != tuple(kv_chunks) or list(q_chunks) != sorted(q_chunks):
            raise ValueError(f"diagonal blocks between query chunks {q_chunks} and K/V chunks {kv_chunks}: "
                             "only a rank's own, increasing chunks can share a diagonal")
        n = len(q_chunks)
        if any(kinds[i][j] == SKIP for i in range(n) for j in range(i)):  # a skipped block below the diagonal
            return [BlockCall(i, i + 1, i, i + 1, causal=True) for i in range(n)]
        return [BlockCall(0, len(q_chunks), 0, len(kv_chunks), causal=True)]
    calls: list[BlockCall] = []
    for qi, row in enumerate(kinds):
        for kv_start, kv_stop in _runs([ki for ki, kind in enumerate(row) if kind == FULL]):
            same = [n for n, c in enumerate(calls) if c.q_stop == qi and (c.kv_start, c.kv_stop) == (kv_start, kv_stop)]
            if same:  # the previous query chunk sees the same keys: extend its call
                calls[same[-1]] = replace(calls[same[-1]], q_stop=qi + 1)
            else:
                calls.append(BlockCall(qi, qi + 1, kv_start, kv_stop, causal=False))
    return calls


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices -> maximal [start, stop) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def ring_plan(cp_rank: int, cp: int, layout: str = "zigzag", *,
              visible: Visible | None = None) -> list[list[BlockCall]]:
    """The calls `cp_rank` makes at each of the cp ring steps (what ring attention executes)."""
    mine = chunk_ids(cp_rank, cp, layout)
    return [step_calls(mine, chunk_ids(ring_source(cp_rank, step, cp), cp, layout), visible=visible)
            for step in range(cp)]


def rank_block_counts(cp_rank: int, cp: int, layout: str = "zigzag", *,
                      visible: Visible | None = None) -> dict[str, int]:
    """{full, diagonal, skip: blocks} over every (own query chunk, K/V chunk) pair of the ring."""
    counts = {FULL: 0, DIAGONAL: 0, SKIP: 0}
    for step in range(cp):
        for kv_chunk in chunk_ids(ring_source(cp_rank, step, cp), cp, layout):
            for q_chunk in chunk_ids(cp_rank, cp, layout):
                counts[_kind(q_chunk, kv_chunk, visible)] += 1
    return counts


def causal_work(counts: dict[str, int]) -> float:
    """Work of counted blocks in chunk x chunk units: a full block 1, a diagonal one 1/2."""
    return counts[FULL] + counts[DIAGONAL] / 2
