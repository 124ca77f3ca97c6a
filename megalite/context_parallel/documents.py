"""Packed documents and sliding windows under context parallelism: which ring blocks to compute, and
each block's mask.

Every cp rank holds the whole sequence's position ids [b, S] (the training step splits only the ids
and labels), so the microbatch's `DocumentMask` (kernels/attention_documents.py) is the whole
sequence's, in global positions: query i sees the keys key_start[i] <= j <= i. Ulysses hands it
as it is to the local attention (after its all-to-all a rank holds whole sequences). Ring attention
reads it per block:

- `chunk_visibility`: which full blocks (query chunk a, K/V chunk b < a, of the 2*cp chunks of
  zigzag.py) hold at least one visible pair, from the documents' lengths (read to the host once
  per microbatch and kept on the mask, as the single-process PyTorch path does). A block wholly
  outside every shared document (or beyond the window) is skipped: no kernel runs for it.
- `RingDocuments.call`: what one ring call computes. A rank's own chunks (the causal call) run
  whole with their `BlockMask` (the global positions of the rows and keys and the rows' key_start;
  the block's attention masks each tile with it, or the varlen kernels take it in the call's rows);
  a full call is cropped to the box of its visible pairs (host arithmetic on key_start, read once
  per microbatch), and runs without a mask when the box is wholly visible.

The zigzag split stays exact (every visible pair is computed once, on the rank holding its query);
it balances the causal work, not the masked work, which packed documents make uneven (Megatron's
THD split, which balances the documents themselves, is measured by balance.py and runs with
--cp-split documents: document_split.py, split_calls.py).
"""
from __future__ import annotations

import torch

from megalite.context_parallel.block_attention import BlockMask
from megalite.context_parallel.blocks import Visible
from megalite.context_parallel.zigzag import check_sequence_length, position_ids
from megalite.kernels import DocumentMask


def _documents(documents: DocumentMask) -> set[tuple[int, int]]:
    """Every sample's documents as [start, end) token ranges (host ints), duplicates merged."""
    spans = set()
    for lengths in documents.document_lengths():
        start = 0
        for length in lengths:
            spans.add((start, start + length))
            start += length
    return spans


def _shares_a_document(q_chunk: int, kv_chunk: int, chunk: int, spans, window: int | None) -> bool:
    """Does any query of q_chunk see a key of the earlier kv_chunk in one of the spans (and window)?"""
    for start, end in spans:
        first_query, query_stop = max(start, q_chunk * chunk), min(end, (q_chunk + 1) * chunk)
        first_key, key_stop = max(start, kv_chunk * chunk), min(end, (kv_chunk + 1) * chunk)
        if first_query < query_stop and first_key < key_stop:  # the nearest pair: first query, last key
            if window is None or first_query - (key_stop - 1) < window:
                return True
    return False


def chunk_visibility(documents: DocumentMask, cp: int) -> Visible:
    """(query chunk, K/V chunk) -> whether that full block holds a visible pair, for ring_plan."""
    seq_len = documents.key_start.shape[1]
    chunk = check_sequence_length(seq_len, cp)
    spans = _documents(documents)
    visible = {(a, b) for a in range(2 * cp) for b in range(a)
               if _shares_a_document(a, b, chunk, spans, documents.window)}
    return lambda q_chunk, kv_chunk: (q_chunk, kv_chunk) in visible


class RingDocuments:
    """One rank's view of the whole sequence's mask for ring attention: its queries' global positions
    and key_start [b, s/cp], the blocks worth computing, and each call's BlockMask."""

    def __init__(self, documents: DocumentMask, cp_rank: int, cp: int, *, layout: str = "zigzag"):
        seq_len = documents.key_start.shape[1]
        self.cp, self.layout, self.seq_len = cp, layout, seq_len
        self.query_positions = position_ids(seq_len, cp_rank, cp, layout, device=documents.key_start.device)
        self.key_start = documents.key_start.index_select(1, self.query_positions).long()  # [b, s/cp]
        self.visible = chunk_visibility(documents, cp)
        self._host_key_start = self.key_start.cpu()  # read once per microbatch, as the lengths are: the crops
        self._crops: dict[tuple[int, ...], tuple[slice, slice, bool] | None] = {}  # forward's, reused by backward

    def call(self, rows: slice, cols: slice, source_rank: int, causal: bool):
        """(rows, cols, mask or None) that one ring call computes, or None when it sees nothing. A causal
        call (a rank's own chunks) runs whole with its mask; a full call is cropped to the rows and keys
        that hold a visible pair, without a mask when every row of the crop sees every key of it (the
        plain kernels then run it: one document crossing the chunk edge, no window)."""
        if causal:
            return rows, cols, self.block_mask(rows, cols, source_rank)
        key = (rows.start, rows.stop, cols.start, cols.stop, source_rank)
        if key not in self._crops:
            self._crops[key] = self._crop(rows, cols, source_rank)
        crop = self._crops[key]
        if crop is None:
            return None
        rows, cols, masked = crop
        return rows, cols, self.block_mask(rows, cols, source_rank) if masked else None

    def _crop(self, rows: slice, cols: slice, source_rank: int) -> tuple[slice, slice, bool] | None:
        """The box of a full call's visible pairs (host tensors): (rows, cols, whether it needs the mask)."""
        keys = position_ids(self.seq_len, source_rank, self.cp, self.layout)[cols]  # increasing
        queries = self.query_positions.cpu()[rows]
        first = torch.searchsorted(keys, self._host_key_start[:, rows].contiguous())  # [b, r]: first key seen
        stop = torch.searchsorted(keys, queries, right=True).expand_as(first)  # one past the last key <= row
        seen = first < stop
        if not bool(seen.any()):
            return None
        seeing_rows = seen.any(0).nonzero().flatten()
        r0, r1 = int(seeing_rows[0]), int(seeing_rows[-1]) + 1
        k0, k1 = int(first[seen].min()), int(stop[seen].max())
        whole = bool(((first[:, r0:r1] == k0) & (stop[:, r0:r1] == k1)).all())
        return slice(rows.start + r0, rows.start + r1), slice(cols.start + k0, cols.start + k1), not whole

    def block_mask(self, rows: slice, cols: slice, source_rank: int) -> BlockMask:
        """The mask of this rank's query rows `rows` against the K/V rows `cols` of `source_rank`."""
        keys = position_ids(self.seq_len, source_rank, self.cp, self.layout, device=self.key_start.device)
        return BlockMask(self.query_positions[rows], keys[cols], self.key_start[:, rows])


def local_documents(documents: DocumentMask | None, cp_rank: int, cp: int, *,
                    layout: str = "zigzag") -> RingDocuments | None:
    """The ring's view of `documents` (None stays None)."""
    return RingDocuments(documents, cp_rank, cp, layout=layout) if documents is not None else None


def check_whole_sequence(documents: DocumentMask, local_tokens: int, cp: int) -> None:
    """The mask must be the whole sequence's ([b, cp * s/cp]), not this rank's chunks."""
    if documents.key_start.shape[1] != local_tokens * cp:
        raise ValueError(f"context-parallel attention needs the whole sequence's document mask "
                         f"([b, {local_tokens * cp}]: position_ids of every token), got "
                         f"{list(documents.key_start.shape)} for {local_tokens} local tokens at cp={cp}")
