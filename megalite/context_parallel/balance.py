"""How evenly a context-parallel split spreads the masked attention work of packed documents
(issue 45): host arithmetic for the planner and the benchmarks, no collectives.

The work of a query token is the number of keys it sees: min(p + 1, window) for the token at
position p of its document (key_start[i] <= j <= i in kernels/attention_documents.py). A cp rank's
work is the sum over the queries it holds; its share is that over the whole sequence's.

- The zigzag split (zigzag.py, what ring attention runs) gives rank r chunks r and 2cp-1-r of the
  *sequence*: exact for one causal sequence, uneven once documents restart the positions.
- The per-document split (Megatron's THD split for cp, `--cp-split documents`) gives rank r chunks r
  and 2cp-1-r of *every document*: each document is balanced on its own, so without a window every
  rank does exactly 1/cp of the work when every length is a multiple of 2cp. The positions are the
  training path's own (`document_split.split_order`: the documents' ends past their 2cp equal chunks
  dealt as one zigzag sequence), so what is measured here is what ring attention runs
  (tests/context_parallel/test_document_split.py counts the pairs its calls compute).
"""
from __future__ import annotations

import torch

from megalite.context_parallel.document_split import rank_positions, split_order
from megalite.context_parallel.zigzag import check_sequence_length, position_ids


def token_work(lengths: list[int], *, window: int | None = None) -> torch.Tensor:
    """Keys each token of the packed sample sees: [sum(lengths)] int64, min(p + 1, window)."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"document lengths must be positive, got {lengths}")
    work = torch.cat([torch.arange(1, n + 1) for n in lengths])
    return work.clamp(max=window) if window is not None else work


def padded_lengths(lengths: list[int], multiple: int) -> list[int]:
    """Each length rounded up to a multiple (the padding a per-document split needs)."""
    return [-(-n // multiple) * multiple for n in lengths]


def document_split_positions(lengths: list[int], cp_rank: int, cp: int) -> torch.Tensor:
    """Global token positions rank `cp_rank` holds under the per-document split the training path runs
    (document_split.split_order of the sample's position ids), in sequence order ([sum(lengths) / cp]
    int64): chunks cp_rank and 2cp-1-cp_rank of every document, and its share of the documents' ends."""
    token_work(lengths)  # the lengths' check
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, s], restarting at each document
    return rank_positions(split_order(positions, cp), cp_rank=cp_rank, cp=cp)[0]


def _shares(work: torch.Tensor, held: list[torch.Tensor]) -> list[float]:
    total = float(work.sum())
    return [float(work[positions].sum()) / total for positions in held]


def zigzag_shares(lengths: list[int], cp: int, *, window: int | None = None) -> list[float]:
    """Each cp rank's share of the masked work under today's zigzag split of the sequence."""
    work = token_work(lengths, window=window)
    check_sequence_length(work.numel(), cp)
    return _shares(work, [position_ids(work.numel(), rank, cp, "zigzag") for rank in range(cp)])


def document_split_shares(lengths: list[int], cp: int, *, window: int | None = None) -> list[float]:
    """Each cp rank's share of the masked work under the per-document (THD) split."""
    work = token_work(lengths, window=window)
    return _shares(work, [document_split_positions(lengths, rank, cp) for rank in range(cp)])


def imbalance(shares: list[float]) -> float:
    """The step's cost over a perfect split's: the busiest rank's share times cp (1.0 is even)."""
    return max(shares) * len(shares)
