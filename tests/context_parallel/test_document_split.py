"""The per-document cp split (--cp-split documents; context_parallel/document_split.py): ring attention
and Ulysses on real gloo rings against the single-process per-document attention of the whole
sequence (output and the q, k, v gradients, float32, 1e-5); the split's rule; and that the work the
ring computes on each rank is what balance.py predicts for the positions the training step hands it.

Documents of one token, odd lengths, lengths that cross the chunk edges, multiples of 2cp (no
remainder: the split is exactly even), and one document filling the whole sequence.
"""
import types

import pytest
import torch

from megalite.config.choices import CPSplit
from megalite.context_parallel import ring_attention, ulysses_attention
from megalite.context_parallel.balance import document_split_positions, document_split_shares, token_work
from megalite.context_parallel.document_split import (gather_tokens, local_tokens, rank_positions, split_documents,
                                                      split_order, split_ranks)
from megalite.context_parallel.split_calls import RingSplit
from megalite.distributed import comm, mesh
from megalite.kernels import DocumentMask
from megalite.kernels.attention_documents import attention_documents_reference
from megalite.testing import run_distributed
from megalite.training.step import context_parallel_chunks

H, H_KV, D = 8, 4, 8
DOCUMENTS = {2: ([1, 5, 3, 7], [16], [8, 4, 4]), 4: ([1, 6, 2, 9, 3, 1, 10], [32], [8, 16, 8])}  # per sample
WINDOW = 3


def _positions(lengths_per_sample) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_sample])


def _inputs(cp):
    gen = torch.Generator().manual_seed(1)
    b, s = len(DOCUMENTS[cp]), sum(DOCUMENTS[cp][0])
    q, k, v = (torch.randn(b, heads, s, D, generator=gen) for heads in (H, H_KV, H_KV))
    return q, k, v, torch.randn(b, H, s, D, generator=gen)


def _reference(cp, mask):
    q, k, v, grad_out = _inputs(cp)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention_documents_reference(*leaves, mask)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _on_rank(t: torch.Tensor, order, m) -> torch.Tensor:
    """[b, h, s, d] -> this rank's tokens [b, h, s/cp, d] under the split."""
    return local_tokens(t.transpose(1, 2), order, cp_rank=m.cp_rank, cp=m.cp_size).transpose(1, 2)


def _run(attention, m, mask):
    """Max |error| of out, dq, dk, dv (this rank's tokens, gathered) against the reference."""
    q, k, v, grad_out = _inputs(m.cp_size)
    local = [_on_rank(t, mask.order, m).requires_grad_(True) for t in (q, k, v)]
    out = attention(*local, m.cp_group, documents=mask)
    out.backward(_on_rank(grad_out, mask.order, m))
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local], _reference(m.cp_size, mask)):
        pieces = comm.all_gather(mine.transpose(1, 2).unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        errors.append((gather_tokens(list(pieces), mask.order).transpose(1, 2) - full).abs().max().item())
    return errors


def _rank_checks(cp):
    m = mesh.init_mesh(cp=cp)
    results = {}
    for case, window in (("documents", None), ("documents+window", WINDOW)):
        mask = split_documents(DocumentMask.from_position_ids(_positions(DOCUMENTS[cp]), window), cp)
        results[f"ring {case}"] = _run(ring_attention, m, mask)
        results[f"ulysses {case}"] = _run(ulysses_attention, m, mask)
    return results


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["cp2", "cp4"])
def world(request):
    return request.param, run_distributed(_rank_checks, request.param, request.param)


@pytest.mark.parametrize("case", ["documents", "documents+window"])
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_attention_under_the_document_split_equals_the_single_process(world, attention, case):
    cp, ranks = world
    for rank, results in enumerate(ranks):
        errors = results[f"{attention} {case}"]
        assert max(errors) < 1e-5, f"cp={cp} rank {rank} {attention} {case}: max |error| of out, dq, dk, dv {errors}"


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_rule(cp):
    """Each document's 2cp chunks (r and 2cp-1-r on rank r), the ends dealt as one zigzag sequence, every
    rank s/cp tokens in sequence order; local_tokens and gather_tokens are inverse."""
    positions = _positions(DOCUMENTS[cp])
    order, ranks = split_order(positions, cp), split_ranks(positions, cp)
    s = positions.shape[1]
    for rank in range(cp):
        held = rank_positions(order, cp_rank=rank, cp=cp)
        assert held.shape[1] == s // cp and bool((held.diff(dim=1) > 0).all())
        assert bool((ranks.gather(1, held) == rank).all())
    if cp == 2:  # sample 2, documents [8, 4, 4]: chunks of 2, 1, 1 tokens
        assert ranks[2].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0]
        # sample 0, documents [1, 5, 3, 7]: chunks of 0, 1, 0, 1 tokens, ends 0 | 5 | 6 7 8 | 15 dealt in 4 pairs
        assert ranks[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 0]
    ids = torch.arange(positions.numel()).view_as(positions)
    shards = [local_tokens(ids, order, cp_rank=rank, cp=cp) for rank in range(cp)]
    assert torch.equal(gather_tokens(shards, order), ids)


def _training_positions(microbatch, rank: int, cp: int) -> torch.Tensor:
    """The global positions the training step hands cp rank `rank` (its ids, which are the positions)."""
    place = types.SimpleNamespace(cp_rank=rank, cp_size=cp)
    return context_parallel_chunks([microbatch], place, CPSplit.DOCUMENTS)[0]["input_ids"][0]


def _computed_pairs(split: RingSplit) -> int:
    """Visible pairs the ring's calls compute on one rank over all its steps (a causal call: its lower
    triangle; a masked call: the mask's pairs)."""
    pairs = 0
    for calls in split.schedule():
        for samples, rows, cols, causal, mask in calls:
            n, k = rows.stop - rows.start, cols.stop - cols.start
            if mask is not None:
                keep = mask.keep(slice(None), slice(None))
                pairs += int((keep & torch.ones(n, k, dtype=torch.bool).tril_() if causal else keep).sum())
            else:
                pairs += n * (n + 1) // 2 if causal else n * k
    return pairs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_the_ring_computes_the_work_balance_py_predicts_for_the_training_steps_positions(cp, window):
    """For random documents: the positions the training step hands each rank (context_parallel_chunks of
    ids that are the positions) are balance.py's, the visible pairs the ring computes on each rank are
    those positions' work (no pair missed or wasted), so the measured shares are balance.py's."""
    gen = torch.Generator().manual_seed(cp)
    s = 32 * cp
    for _ in range(3):
        cuts = sorted(set(torch.randint(1, s, (8,), generator=gen).tolist()))
        lengths = [b - a for a, b in zip([0] + cuts, cuts + [s])]
        positions = _positions([lengths])
        mask = split_documents(DocumentMask.from_position_ids(positions, window), cp)
        work = token_work(lengths, window=window)
        measured = []
        for rank in range(cp):
            ids = torch.arange(s)[None]
            microbatch = {"input_ids": ids, "labels": ids, "position_ids": positions}
            held = _training_positions(microbatch, rank, cp)
            assert torch.equal(held, document_split_positions(lengths, rank, cp))
            pairs = _computed_pairs(RingSplit(mask, cp_rank=rank, cp=cp))
            assert pairs == int(work[held].sum())
            measured.append(pairs / float(work.sum()))
        assert measured == pytest.approx(document_split_shares(lengths, cp, window=window), abs=1e-12)
        if window is None and all(n % (2 * cp) == 0 for n in lengths):
            assert measured == pytest.approx([1 / cp] * cp)


def test_a_mask_split_for_another_cp_is_refused():
    mask = split_documents(DocumentMask.from_position_ids(_positions(DOCUMENTS[2])), 2)
    with pytest.raises(ValueError, match="split over 2 cp ranks, the cp group has 4; split it with "
                                         "split_documents\\(mask, 4\\)"):
        RingSplit(mask, cp_rank=0, cp=4)
