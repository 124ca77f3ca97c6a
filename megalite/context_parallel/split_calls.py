"""Ring attention's calls under the per-document split (document_split.py): one rank's queries against
one held K/V, document by document.

A rank's tokens are in sequence order, so its tokens of one document are one contiguous local run, and
so are the source rank's. A ring step computes, for every sample and every document it shares with the
held K/V, the box of the visible pairs (key_start[i] <= j <= i in global positions) between the
document's query run and its key run:

- the rank's own K/V: the document's run against itself, a causal square (positions increase along
  it), without a mask unless a window cuts it;
- another rank's: a full call cropped to the box of its visible pairs. Under the per-document split
  without a window the box is wholly visible (chunk s of a document lies wholly before or after
  chunks r and 2cp-1-r), so it runs without a mask: the plain kernels on CUDA. The documents' ends
  dealt as one zigzag sequence, or a window, can leave a box that needs its mask (`BlockMask`, the
  PyTorch block code).

No pair outside a document is ever computed, and every visible pair once, on its query's rank. The
boxes are host arithmetic on the split order and key_start, read to the host once per microbatch
(the zigzag path reads the documents' lengths the same way).
"""
from __future__ import annotations

import torch

from megalite.context_parallel.block_attention import BlockMask
from megalite.context_parallel.document_split import SplitDocumentMask, check_split, rank_positions

Call = tuple[slice, slice, slice, bool, BlockMask | None]  # (samples, rows, cols, causal, mask or None)


class RingSplit:
    """One rank's view of a SplitDocumentMask for ring attention: the calls of each held K/V."""

    def __init__(self, documents: SplitDocumentMask, *, cp_rank: int, cp: int):
        check_split(documents, cp)
        self.cp_rank, self.cp = cp_rank, cp
        self.order = documents.order  # [b, s] on the device
        self.query_positions = rank_positions(self.order, cp_rank=cp_rank, cp=cp)  # [b, s/cp]
        self.key_start = documents.key_start.long().gather(1, self.query_positions)  # [b, s/cp]
        self._host_order = self.order.cpu()
        self._host_key_start = self.key_start.cpu()
        self._lengths = documents.document_lengths()

    def calls(self, source_rank: int) -> list[Call]:
        """Every call of this rank's queries against `source_rank`'s K/V, sample by sample, document by
        document (a document with no visible pair between them makes none)."""
        calls = []
        for sample, lengths in enumerate(self._lengths):
            queries, keys = self._positions(sample, self.cp_rank), self._positions(sample, source_rank)
            start = 0
            for length in lengths:
                bounds = torch.tensor([start, start + length])
                rows = slice(*torch.searchsorted(queries, bounds).tolist())
                cols = slice(*torch.searchsorted(keys, bounds).tolist())
                if rows.start < rows.stop and cols.start < cols.stop:
                    call = self._call(sample, rows, cols=cols, source_rank=source_rank, document_start=start)
                    if call is not None:
                        calls.append(call)
                start += length
        return calls

    def schedule(self) -> list[list[Call]]:
        """The calls of each ring step (step t holds the K/V of rank cp_rank - t)."""
        return [self.calls((self.cp_rank - step) % self.cp) for step in range(self.cp)]

    def _positions(self, sample: int, rank: int) -> torch.Tensor:
        """[s/cp] host int64: the global positions `rank` holds of `sample`, increasing."""
        return rank_positions(self._host_order[sample:sample + 1], cp_rank=rank, cp=self.cp)[0]

    def _call(self, sample: int, rows: slice, *, cols: slice, source_rank: int, document_start: int) -> Call | None:
        """One document's call: its query run `rows` against its key run `cols` (local indices)."""
        samples = slice(sample, sample + 1)
        if source_rank == self.cp_rank:  # its run against itself: causal; masked only where a window cuts it
            causal, masked = True, bool((self._host_key_start[sample, rows] > document_start).any())
        else:
            box = self._crop(sample, rows, cols=cols, source_rank=source_rank)
            if box is None:
                return None
            (rows, cols, masked), causal = box, False
        mask = self.block_mask(sample, rows, cols=cols, source_rank=source_rank) if masked else None
        return samples, rows, cols, causal, mask

    def _crop(self, sample: int, rows: slice, *, cols: slice, source_rank: int) -> tuple[slice, slice, bool] | None:
        """The box of the visible pairs between a document's rows and keys (host tensors): (rows, cols,
        whether the box needs its mask), or None when no row sees a key."""
        keys = self._positions(sample, source_rank)[cols]  # increasing
        queries = self._positions(sample, self.cp_rank)[rows]
        first = torch.searchsorted(keys, self._host_key_start[sample, rows].contiguous())  # first key seen
        stop = torch.searchsorted(keys, queries, right=True)  # one past the last key <= the row
        seen = first < stop
        if not bool(seen.any()):
            return None
        seeing = seen.nonzero().flatten()
        r0, r1 = int(seeing[0]), int(seeing[-1]) + 1
        k0, k1 = int(first[seen].min()), int(stop[seen].max())
        whole = bool(((first[r0:r1] == k0) & (stop[r0:r1] == k1)).all())
        return slice(rows.start + r0, rows.start + r1), slice(cols.start + k0, cols.start + k1), not whole

    def block_mask(self, sample: int, rows: slice, *, cols: slice, source_rank: int) -> BlockMask:
        """The mask of this rank's rows `rows` of `sample` against `source_rank`'s K/V `cols`, global positions."""
        keys = rank_positions(self.order[sample:sample + 1], cp_rank=source_rank, cp=self.cp)[0]
        return BlockMask(self.query_positions[sample, rows], keys[cols], self.key_start[sample:sample + 1, rows])
