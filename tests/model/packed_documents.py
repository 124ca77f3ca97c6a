"""The reference every packed-documents model test compares with: the batch (ids, labels with a loss
mask, restarting position ids) and each document run alone through a one-process model."""
from __future__ import annotations

import torch

from megalite.context_parallel.document_split import gather_tokens, local_tokens, split_order
from megalite.context_parallel.zigzag import gather_sequence, split_sequence
from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.testing import assert_tensor_close


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


def packed_run(model, ids, labels, positions):
    """The whole batch through `model` (tp 1) at its cp size, as the training step hands it: each cp rank
    its zigzag chunks of ids [b, s] and labels (under cp_split "documents" its tokens of the per-document
    split, `local_tokens`), and the whole sequence's position ids (or None). Returns
    (logits [b, s, V_pad], the loss sum, each MTP depth's summed loss [D] (float64, empty without MTP),
    every parameter's gradient by logical name), each over the whole sequence: under cp the logits
    gathered, the sums and the gradients (each rank holds its tokens' part) summed over the cp ranks."""
    cp, rank = model.cp_size, model.cp_rank
    order = split_order(positions, cp) if cp > 1 and model.cp_split == "documents" else None
    if order is not None:
        ids, labels = (local_tokens(t, order, cp_rank=rank, cp=cp) for t in (ids, labels))
    elif cp > 1:
        ids, labels = (split_sequence(t, rank, cp) for t in (ids, labels))
    logits = model(ids, position_ids=positions).detach()  # [b, s/cp, V_pad]
    loss = model(ids, labels, reduction="sum", position_ids=positions)
    loss.backward()
    depths = torch.tensor(model.mtp.take_step_sums() if model.mtp is not None else [], dtype=torch.float64)
    grads = {n: P.shard_spec(p).assemble([p.grad]) for n, p in model.logical_parameters()}
    loss = loss.detach()
    if cp > 1:
        group = model.groups.cp
        pieces = comm.all_gather(logits.unsqueeze(0).contiguous(), group, dim=0).unbind(0)
        logits = gather_sequence(list(pieces), dim=1) if order is None else gather_tokens(list(pieces), order)
        loss, depths = (comm.all_reduce(t.clone(), group) for t in (loss, depths))
        grads = {n: comm.all_reduce(g.clone(), group) for n, g in grads.items()}
    return logits, loss, depths, grads


def assert_same_mtp_run(run, expected, *, vocab: int, what: str) -> int:
    """`run` and `expected`, each (logits, loss, MTP depth losses, {param: grad}), equal to float32 rounding
    (logits over the real vocabulary); returns the number of gradients compared."""
    logits, loss, depths, grads = run
    ref_logits, ref_loss, ref_depths, ref_grads = expected
    torch.testing.assert_close(logits[..., :vocab], ref_logits[..., :vocab], rtol=1e-5, atol=1e-5, msg=what)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(depths, ref_depths, rtol=1e-5, atol=0, msg=what)
    assert grads.keys() == ref_grads.keys(), what
    for param, grad in ref_grads.items():
        assert_tensor_close(grads[param], grad, rtol=1e-5, what=f"{what} {param}")
    return len(grads)
