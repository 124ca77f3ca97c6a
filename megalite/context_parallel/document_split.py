"""The per-document context-parallel split (`--cp-split documents`; Megatron's THD split for cp): each
cp rank holds chunks r and 2cp-1-r of *every document*, so each document's causal work is balanced on
its own and, without a window, every rank does exactly 1/cp of the masked attention work (the zigzag
split of the sequence leaves the busiest rank 1.18x an even share at cp 2 on 8k sequences of
512-token documents; context_parallel/balance.py, docs/documents.md).

The rule, per sample, from its restarting position ids alone (every rank computes the same):

- a document of L tokens is cut into 2cp chunks of c = L // 2cp tokens (its first 2cp*c tokens);
  rank r holds chunks r and 2cp-1-r;
- the L % 2cp tokens left at each document's end (all of a document shorter than 2cp) are taken in
  sequence order and split like the zigzag split of one sequence: 2cp equal chunks (their count is a
  multiple of 2cp because the sequence's is), rank r holds chunks r and 2cp-1-r of them;
- a rank's s/cp tokens are kept in sequence order (their global positions increase along its local
  sequence), so its tokens of one document are one contiguous local run.

Nothing is padded: shapes are those of the zigzag split, the loss is a sum over tokens (any
permutation of the tokens gives it), RoPE and the learned table read each token's own position id.
The remainder tokens are what keeps it from being exactly even when lengths are not multiples of
2cp (measured by balance.py on the same positions).

`order` [b, s] int64 is the split: order[:, r*s/cp:(r+1)*s/cp] are rank r's tokens' global
positions, increasing. It travels on the microbatch's document mask (`SplitDocumentMask`), which ring
attention (split_calls.py) and Ulysses read; the training step hands each rank its tokens with
`local_tokens`, and `gather_tokens` puts every rank's back in sequence order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megalite.context_parallel.zigzag import check_sequence_length
from megalite.kernels import DocumentMask


def _document_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, length) [b, s] of each token's document, from restarting position ids [b, s]."""
    b, s = position_ids.shape
    rows = torch.arange(s, device=position_ids.device)
    start = rows - position_ids
    starts = torch.where(position_ids == 0, rows, s)
    following = torch.cat([starts[:, 1:], torch.full((b, 1), s, device=starts.device, dtype=starts.dtype)], 1)
    end = following.flip(1).cummin(1).values.flip(1)  # one past each token's document
    return start, end - start


def _zigzag_rank(chunk: torch.Tensor, cp: int) -> torch.Tensor:
    """Chunk index 0..2cp-1 -> the rank holding it (r holds r and 2cp-1-r)."""
    return torch.minimum(chunk, 2 * cp - 1 - chunk)


def split_ranks(position_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s] int64: the cp rank holding each token under the per-document split (tensor arithmetic:
    no host read)."""
    check_sequence_length(position_ids.shape[1], cp)
    position_ids = position_ids.long()
    _, length = _document_bounds(position_ids)
    chunk = length // (2 * cp)  # [b, s] tokens per chunk of the token's document
    bulk = position_ids < 2 * cp * chunk  # in the document's 2cp equal chunks
    rank = _zigzag_rank(position_ids // chunk.clamp(min=1), cp)
    left = ~bulk  # the documents' ends, split as one zigzag sequence
    index = left.long().cumsum(1) - 1  # [b, s]: each left token's place among its sample's
    per_chunk = (left.sum(1, keepdim=True) // (2 * cp)).clamp(min=1)  # [b, 1]
    return torch.where(bulk, rank, _zigzag_rank(index // per_chunk, cp))


def split_order(position_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s] int64: rank r's tokens' global positions at order[:, r*s/cp:(r+1)*s/cp], increasing."""
    s = position_ids.shape[1]
    rows = torch.arange(s, device=position_ids.device)
    return torch.argsort(split_ranks(position_ids, cp) * s + rows, dim=1)


@dataclasses.dataclass(eq=False)
class SplitDocumentMask(DocumentMask):
    """The whole sequence's document mask, with the per-document split's `order` [b, s] (split_order):
    what context-parallel attention reads to know which global positions each rank holds."""

    order: torch.Tensor | None = None
    cp: int = 1
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def memo(self, key, build: Callable[[], Any]) -> Any:
        """build() once per mask (so once per microbatch, for every layer): the ring's calls, built from
        host reads of the order and key_start, are the same in every layer."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


def split_documents(documents: DocumentMask, cp: int) -> SplitDocumentMask:
    """The mask of `documents` carrying the per-document split of their position ids over cp ranks."""
    fields = {f.name: getattr(documents, f.name) for f in dataclasses.fields(DocumentMask)}
    return SplitDocumentMask(**fields, order=split_order(documents.position_ids, cp), cp=cp)


def check_split(documents: SplitDocumentMask, cp: int) -> None:
    """The mask's split must be over the cp group's ranks (ValueError naming the fix)."""
    if documents.cp != cp:
        raise ValueError(f"the document mask is split over {documents.cp} cp ranks, the cp group has {cp}; "
                         f"split it with split_documents(mask, {cp})")


def rank_positions(order: torch.Tensor, *, cp_rank: int, cp: int) -> torch.Tensor:
    """[b, s/cp]: the global positions rank `cp_rank` holds (increasing)."""
    local = order.shape[1] // cp
    return order[:, cp_rank * local:(cp_rank + 1) * local]


def local_tokens(tensor: torch.Tensor, order: torch.Tensor, *, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor [b, s, ...] (ids, labels, position ids) -> [b, s/cp, ...]."""
    index = rank_positions(order, cp_rank=cp_rank, cp=cp).to(tensor.device)
    index = index.view(*index.shape, *([1] * (tensor.dim() - 2))).expand(*index.shape, *tensor.shape[2:])
    return tensor.gather(1, index)


def gather_tokens(shards: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    """Inverse of `local_tokens`: every rank's [b, s/cp, ...] (by cp rank) -> the whole [b, s, ...]."""
    ranked = torch.cat(shards, dim=1)  # [b, s, ...] in rank order: position order[:, i] at i
    index = order.to(ranked.device)
    index = index.view(*index.shape, *([1] * (ranked.dim() - 2))).expand_as(ranked)
    return torch.empty_like(ranked).scatter_(1, index, ranked)
