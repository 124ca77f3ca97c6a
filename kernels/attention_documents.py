"""Packed documents (and a sliding window) as data for the attention kernels: `DocumentMask`.

A packed sample holds several documents back to back; `position_ids` [b, s] restart at 0 at each
one (transformers' padding-free convention). Query row i may see key j iff

    key_start[i] <= j <= i,     key_start[i] = max(i - position_ids[i], i - window + 1)

(its document's first token, or the window's, whichever is later; window None: no window). The
same mask read from the key's side: key j is seen by the queries j <= i < query_end[j], with
query_end[j] = min(end of j's document, j + window). Both are monotone in their index, so a query
block's keys and a key block's queries are one range each: the Triton kernels skip every tile
outside it (work ~ sum of len^2 over documents, not s^2) and mask only the tiles crossing an edge.

Built once per microbatch (`from_position_ids`, device tensor arithmetic only: no host read) and
handed to every layer. The PyTorch path (`attention_documents_reference`) runs SDPA once per
document: the documents' lengths are read to the host once per microbatch, the first time a
layer needs them, and kept on the object (on a GPU that path is the fallback; the Triton kernels
read the two tensors on the device). FlexAttention's block mask was measured against it and has
no backward on the CPU (docs/documents.md).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .attention_dispatch import repeat_kv_heads


@dataclasses.dataclass(eq=False)
class DocumentMask:
    """The mask of one microbatch's packed documents, all [b, s] int32 on the activations' device.

    key_start: the first key each query row sees; query_end: one past the last query row that
    sees each key; position_ids: int64, the restarting positions it was built from; window: the
    sliding window (keys i - window < j <= i) or None.
    """

    key_start: torch.Tensor
    query_end: torch.Tensor
    position_ids: torch.Tensor
    window: int | None = None
    _lengths: list[list[int]] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, window: int | None = None) -> "DocumentMask":
        """position_ids [b, s] (0 at each document's first token, then +1 per token) -> the mask."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [b, s], got shape {tuple(position_ids.shape)}")
        if window is not None and window < 1:
            raise ValueError(f"the attention window must be >= 1 token, got {window}")
        b, s = position_ids.shape
        rows = torch.arange(s, device=position_ids.device)
        doc_start = rows - position_ids  # [b, s]
        # a document's end = the next document's start: starts marked, then a running minimum from the right
        starts = torch.where(position_ids == 0, rows, s)  # [b, s]
        following = torch.cat([starts[:, 1:], torch.full((b, 1), s, device=starts.device, dtype=starts.dtype)], 1)
        doc_end = following.flip(1).cummin(1).values.flip(1)  # [b, s]: one past each token's document
        if window is not None:
            doc_start = torch.maximum(doc_start, rows - window + 1)
            doc_end = torch.minimum(doc_end, rows + window)
        return cls(doc_start.to(torch.int32).contiguous(), doc_end.to(torch.int32).contiguous(),
                   position_ids, window)

    @classmethod
    def sliding_window(cls, batch: int, seq_len: int, window: int, device=None) -> "DocumentMask":
        """One document per sample, a window only: positions 0..s-1."""
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return cls.from_position_ids(positions, window)

    def document_lengths(self) -> list[list[int]]:
        """Each sample's document lengths (host ints), read once and kept: the PyTorch path's loop."""
        if self._lengths is None:
            lengths = []
            for row in self.position_ids.tolist():
                starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
                lengths.append([end - start for start, end in zip(starts[:-1], starts[1:])])
            self._lengths = lengths
        return self._lengths

    def visible_pairs(self) -> torch.Tensor:
        """(query, key) pairs the mask keeps, summed over the batch: sum_i (i - key_start[i] + 1), int64."""
        rows = torch.arange(self.key_start.shape[1], device=self.key_start.device)
        return (rows - self.key_start + 1).sum(dtype=torch.int64)


def _document_attention(q, k, v, softmax_scale: float, window: int | None) -> torch.Tensor:
    """One document: q [1, h, n, d], k, v [1, h, n, d] (heads repeated) -> causal (windowed) SDPA."""
    n = q.shape[2]
    if window is None or window >= n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale)
    rows = torch.arange(n, device=q.device)
    offset = rows[:, None] - rows[None, :]  # [n, n] within this document only
    keep = (offset >= 0) & (offset < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=softmax_scale)


def attention_documents_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask,
                                  softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention within each document: q [b, h, s, d], k, v [b, h_kv, s, d] -> [b, h, s, d].

    One SDPA call per (sample, document), as if each document were its own sequence."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)
    samples = []
    for index, lengths in enumerate(documents.document_lengths()):
        parts, start = [], 0
        for length in lengths:
            rows = slice(start, start + length)
            parts.append(_document_attention(q[index:index + 1, :, rows], k[index:index + 1, :, rows],
                                             v[index:index + 1, :, rows], softmax_scale, documents.window))
            start += length
        samples.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(samples, dim=0) if len(samples) > 1 else samples[0]
