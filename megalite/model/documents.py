"""The documents of a packed microbatch as GPTModel reads them: each sample's position ids, which
restart at 0 where a document starts (transformers' padding-free convention), give the attention mask
every block shares, and under context parallelism this rank's tokens of them (its zigzag chunks, or
with --cp-split documents its chunks of every document).

Shapes: position_ids [b, s * cp], the whole sequence's (the mask is built in whole-sequence positions,
which ring attention and Ulysses read); RoPE and the learned table read this rank's chunks [b, s].
"""
from __future__ import annotations

import torch

from megalite.config.choices import CPSplit
from megalite.context_parallel.document_split import SplitDocumentMask, local_tokens, split_documents
from megalite.context_parallel.zigzag import split_sequence
from megalite.kernels import DocumentMask


def document_mask(window: int | None, position_ids: torch.Tensor | None, batch: int, whole: int,
                  device, *, cp_size: int = 1, cp_split: str = CPSplit.ZIGZAG) -> DocumentMask | None:
    """The attention mask every block shares: packed documents and/or the sliding window over the
    whole sequence's `whole` tokens; None for plain causal attention (a window as long as the sequence
    is no window). Packed documents under cp with cp_split "documents" carry the per-document split
    (context_parallel/document_split.py: which tokens each cp rank holds)."""
    window = window if window is not None and window < whole else None
    if position_ids is not None:
        mask = DocumentMask.from_position_ids(position_ids, window)
        return split_documents(mask, cp_size) if cp_split == CPSplit.DOCUMENTS and cp_size > 1 else mask
    return DocumentMask.sliding_window(batch, whole, window, device) if window is not None else None


def local_positions(position_ids: torch.Tensor | None, cp_rank: int, cp_size: int, *,
                    documents: DocumentMask | None = None) -> torch.Tensor | None:
    """The whole sequence's position ids [b, s * cp] -> this cp rank's tokens' [b, s]: its zigzag chunks,
    or under the per-document split (a SplitDocumentMask) its chunks of every document."""
    if position_ids is None or cp_size == 1:
        return position_ids
    if isinstance(documents, SplitDocumentMask):
        return local_tokens(position_ids, documents.order, cp_rank=cp_rank, cp=cp_size)
    return split_sequence(position_ids, cp_rank, cp_size, dim=1)


def check_position_ids(position_ids: torch.Tensor | None, batch: int, s: int, cp_size: int) -> None:
    """Shapes only (a value check would read the device): the data side checks the restarts. Under cp
    they are the whole sequence's [b, s * cp], not this rank's chunks."""
    if position_ids is None:
        return
    if tuple(position_ids.shape) != (batch, s * cp_size):
        whole = " (the whole sequence's, under context parallelism)" if cp_size > 1 else ""
        raise ValueError(f"position_ids have shape {tuple(position_ids.shape)}; the microbatch is "
                         f"[{batch}, {s * cp_size}]{whole}")


def check_cp_split(config, cp_split: str, cp_size: int) -> None:
    """What the per-document cp split cannot run yet (config.checks.cp_split_problems says it for the
    command line): dropout, whose random stream follows each token's logical offset in the zigzag order
    (docs/documents.md)."""
    if CPSplit(cp_split) != CPSplit.DOCUMENTS or cp_size == 1:
        return
    if config.hidden_dropout > 0 or config.attention_dropout > 0:
        raise ValueError("cp_split='documents' does not run with dropout yet; use cp_split='zigzag'")
