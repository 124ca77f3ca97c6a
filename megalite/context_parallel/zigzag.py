"""The load-balanced ("zigzag") split of a sequence over the context-parallel ranks.

Causal attention work grows along the sequence: the query at position t attends to t + 1 keys.
Cutting the sequence into cp contiguous pieces would give the last rank ~(2cp - 1) times the
work of the first. Cut it into 2*cp chunks instead and give rank i chunks i and 2cp-1-i (an
early and a late one): every rank then has the same causal work (Brandon et al. 2023,
"Striped attention"; Megatron-core's load-balanced CP). With cp = 2 and 8 tokens:

    positions  0 1 | 2 3 | 4 5 | 6 7        chunks 0 | 1 | 2 | 3
    rank 0     0 1             6 7          chunks 0 and 3
    rank 1           2 3 | 4 5              chunks 1 and 2

A rank's local sequence is its two chunks concatenated (positions still increase along it).
Everything that needs to know where a local token sits (positions for RoPE or a learned
table, the ring's block plan, Ulysses' reordering) asks `chunk_ids`. "contiguous" (rank i
holds chunks 2i and 2i+1) exists only to show that the balance test can fail.
"""
from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(cp_rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of 2*cp, in sequence order) that `cp_rank` holds."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp}")
    if layout == "zigzag":
        return cp_rank, 2 * cp - 1 - cp_rank
    if layout == "contiguous":
        return 2 * cp_rank, 2 * cp_rank + 1
    raise ValueError(f"unknown context-parallel layout {layout!r}; choose from {LAYOUTS}")


def check_sequence_length(seq_len: int, cp: int) -> int:
    """The chunk length seq_len / (2 cp); ValueError naming the fix when it does not divide."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp} (the load-balanced split "
                         f"cuts it into 2*cp chunks); choose a sequence length that is a multiple of {2 * cp}")
    return seq_len // (2 * cp)


def split_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1,
                   layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a full-sequence tensor: its two chunks concatenated along `dim`.

    Input ids or labels [b, s] -> [b, s/cp] (dim=1); hidden states [s, b, h] -> [s/cp, b, h] (dim=0).
    """
    if cp == 1:
        return tensor
    chunk = check_sequence_length(tensor.shape[dim], cp)
    first, second = chunk_ids(cp_rank, cp, layout)
    return torch.cat([tensor.narrow(dim, first * chunk, chunk), tensor.narrow(dim, second * chunk, chunk)], dim=dim)


def position_ids(seq_len: int, cp_rank: int, cp: int, layout: str = "zigzag",
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions [seq_len/cp] (int64) of this rank's local tokens; seq_len is the full length."""
    chunk = check_sequence_length(seq_len, cp)
    first, second = chunk_ids(cp_rank, cp, layout)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def gather_sequence(shards: list[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of `split_sequence`: every rank's local part (by cp rank) -> the full sequence."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first_half, second_half = shard.chunk(2, dim=dim)
        first, second = chunk_ids(rank, cp, layout)
        chunks[first], chunks[second] = first_half, second_half
    return torch.cat(chunks, dim=dim)


def logical_row_offsets(local_rows: int, row_numel: int, shard: int, shards: int, cp_rank: int,
                        cp: int) -> int | list[tuple[int, int, int]]:
    """Where this rank's rows sit in the logical (whole-sequence) tensor [s, ...], as element offsets.

    The rank holds `local_rows` rows: sequence-parallel shard `shard` of `shards` of its cp-local
    sequence (its two zigzag chunks concatenated). Returns the element offset of its first row
    when they are one contiguous run of the logical tensor (always at cp = 1), else
    [(first local row, element offset, rows)] for each contiguous run (at most two). Dropout
    masks are drawn over the logical tensor, so every layout drops the same elements.
    """
    first = shard * local_rows
    if cp == 1:
        return first * row_numel
    chunk = local_rows * shards // 2  # rows per zigzag chunk
    runs: list[tuple[int, int, int]] = []
    for which, chunk_id in enumerate(chunk_ids(cp_rank, cp)):
        lo, hi = max(first, which * chunk), min(first + local_rows, (which + 1) * chunk)
        if lo < hi:
            runs.append((lo - first, (chunk_id * chunk + lo - which * chunk) * row_numel, hi - lo))
    return runs[0][1] if len(runs) == 1 else runs
