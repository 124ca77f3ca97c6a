"""The reference every packed-documents model test compares with: the batch (ids, labels with a loss
mask, restarting position ids) and each document run alone through a one-process model."""
from __future__ import annotations

import torch

from megalite.parameters import params as P


def documents_batch(vocab: int, documents: tuple[list[int], ...], seq: int, *,
                    masked: tuple[tuple[int, int], ...] = ((0, 2), (1, 9))):
    """(ids [b, s], labels [b, s] with the `masked` (sample, token) targets -100, position_ids [b, s]
    restarting at each document) for `documents`, one list of lengths per sample, each summing to `seq`."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(documents), seq), generator=gen)
    labels = torch.randint(0, vocab, (len(documents), seq), generator=gen)
    for sample, token in masked:  # a loss mask: the sum skips them, the mean does not count them
        labels[sample, token] = -100
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in documents])
    return ids, labels, positions


def one_by_one(model, documents: tuple[list[int], ...], seq: int, vocab: int, padded_vocab: int, *,
               masked: tuple[tuple[int, int], ...] = ((0, 2), (1, 9))):
    """Each document of `documents_batch` alone through `model` (one process): logits [b, s, V_pad],
    the summed loss, and every parameter's whole gradient by logical name."""
    ids, labels, _ = documents_batch(vocab, documents, seq, masked=masked)
    logits, loss = torch.zeros(len(documents), seq, padded_vocab), torch.zeros(())
    for b, lengths in enumerate(documents):
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            logits[b, rows] = model(ids[b:b + 1, rows]).detach()[0]
            document_loss = model(ids[b:b + 1, rows], labels[b:b + 1, rows], reduction="sum")
            document_loss.backward()
            loss += document_loss.detach()
            start += n
    return logits, loss, {n: P.shard_spec(p).assemble([p.grad]) for n, p in model.logical_parameters()}
