"""Ring attention and Ulysses with packed documents and sliding windows, on real gloo rings, against
the single-process per-document attention (kernels.attention_documents_reference) of the whole
sequence: outputs and the gradients of q, k and v, float32, 1e-5.

Documents of one token, documents that cross the cp chunk edges (chunks of 4 tokens), and a sample
that is one document filling the whole sequence; a window alone and a window over documents.
Also: which ring blocks a rank computes (a block sharing no document with its keys is skipped,
checked against a brute-force count of the visible pairs), and that the comparison can fail
(the same inputs without the mask differ).
"""
import itertools

import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.context_parallel import gather_sequence, rank_block_counts, ring_attention, split_sequence, \
    ulysses_attention
from megalite.context_parallel.blocks import FULL, SKIP, ring_plan, ring_source
from megalite.context_parallel.zigzag import chunk_ids
from megalite.context_parallel.documents import RingDocuments, chunk_visibility
from megalite.kernels import DocumentMask
from megalite.kernels.attention_documents import attention_documents_reference
from megalite.testing import run_distributed

B, H, H_KV, D, CHUNK = 2, 8, 4, 8, 4  # each rank holds 2 chunks of CHUNK tokens
DOCUMENTS = {2: ([1, 5, 3, 7], [16]), 4: ([1, 6, 2, 9, 3, 1, 10], [32])}  # per cp: per sample, summing to s
CASES = {"documents": (True, None), "window": (False, 3), "documents+window": (True, 3)}


def _positions(cp, documents: bool) -> torch.Tensor:
    s = 2 * cp * CHUNK
    if not documents:
        return torch.arange(s).expand(B, s)
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in DOCUMENTS[cp]])


def _inputs(cp):
    gen = torch.Generator().manual_seed(1)
    s = 2 * cp * CHUNK
    q, k, v = (torch.randn(B, heads, s, D, generator=gen) for heads in (H, H_KV, H_KV))
    return q, k, v, torch.randn(B, H, s, D, generator=gen)


def _reference(cp, mask):
    q, k, v, grad_out = _inputs(cp)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention_documents_reference(*leaves, mask)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _run(attention, m, mask):
    """Max |error| of out, dq, dk, dv (this rank's chunks, gathered) against the reference."""
    q, k, v, grad_out = _inputs(m.cp_size)
    local = [split_sequence(t, m.cp_rank, m.cp_size, dim=2).requires_grad_(True) for t in (q, k, v)]
    out = attention(*local, m.cp_group, documents=mask)
    out.backward(split_sequence(grad_out, m.cp_rank, m.cp_size, dim=2))
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local], _reference(m.cp_size, mask)):
        pieces = comm.all_gather(mine.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        errors.append((gather_sequence(list(pieces), dim=2) - full).abs().max().item())
    return errors


def _rank_checks(cp):
    m = mesh.init_mesh(cp=cp)
    results = {}
    for case, (documents, window) in CASES.items():
        mask = DocumentMask.from_position_ids(_positions(cp, documents), window)
        results[f"ring {case}"] = _run(ring_attention, m, mask)
        results[f"ulysses {case}"] = _run(ulysses_attention, m, mask)
    q, k, v, _ = (split_sequence(t, m.cp_rank, m.cp_size, dim=2) for t in _inputs(cp))
    plain = ring_attention(q, k, v, m.cp_group)
    masked = ring_attention(q, k, v, m.cp_group, documents=DocumentMask.from_position_ids(_positions(cp, True)))
    results["mask changes the output"] = not torch.allclose(plain, masked, atol=1e-3)
    try:  # this rank's chunks of the position ids, not the whole sequence's: refused
        ring_attention(q, k, v, m.cp_group, documents=DocumentMask.from_position_ids(_positions(cp, True)[:, :8]))
        results["refusal"] = None
    except ValueError as exc:
        results["refusal"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["cp2", "cp4"])
def world(request):
    return request.param, run_distributed(_rank_checks, request.param, request.param)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_context_parallel_attention_with_documents_equals_the_single_process(world, attention, case):
    cp, ranks = world
    for rank, results in enumerate(ranks):
        errors = results[f"{attention} {case}"]
        assert max(errors) < 1e-5, f"cp={cp} rank {rank} {attention} {case}: max |error| of out, dq, dk, dv {errors}"


def test_the_mask_matters_and_a_local_mask_is_refused(world):
    cp, ranks = world
    for results in ranks:
        assert results["mask changes the output"]
        assert "needs the whole sequence's document mask" in results["refusal"]


def _visible_pairs_brute_force(mask: DocumentMask, cp: int) -> set[tuple[int, int]]:
    """(query chunk, key chunk) blocks holding a pair key_start[i] <= j <= i, from the dense mask."""
    s = mask.key_start.shape[1]
    rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
    dense = (cols <= rows) & (cols >= mask.key_start[:, :, None])  # [b, s, s]
    seen = dense.any(0).reshape(2 * cp, s // (2 * cp), 2 * cp, s // (2 * cp)).any(3).any(1)
    return {(a, b) for a, b in itertools.product(range(2 * cp), repeat=2) if seen[a, b] and a > b}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_ring_computes_exactly_the_blocks_that_hold_a_visible_pair(cp, window):
    gen = torch.Generator().manual_seed(cp * 10 + (window or 0))
    s = 2 * cp * CHUNK
    for _ in range(20):  # random document cuts, a start at 0 always
        starts = (torch.rand(B, s, generator=gen) < 0.25)
        starts[:, 0] = True
        positions = torch.stack([torch.cat([torch.arange(n) for n in torch.diff(torch.cat(
            [row.nonzero().flatten(), torch.tensor([s])])).tolist()]) for row in starts])
        mask = DocumentMask.from_position_ids(positions, window)
        visible = chunk_visibility(mask, cp)
        expected = _visible_pairs_brute_force(mask, cp)
        assert {(a, b) for a in range(2 * cp) for b in range(a) if visible(a, b)} == expected
        for rank in range(cp):  # the plan covers the visible blocks, and only them
            assert _covered_blocks(rank, cp, visible) == {(a, b) for a, b in expected if rank in _owners(a, cp)} | \
                {(a, a) for a in chunk_ids(rank, cp)}
            plain, counts = rank_block_counts(rank, cp), rank_block_counts(rank, cp, visible=visible)
            assert counts[FULL] + counts[SKIP] == plain[FULL] + plain[SKIP]


def _owners(chunk: int, cp: int) -> set[int]:
    return {rank for rank in range(cp) if chunk in chunk_ids(rank, cp)}


def _covered_blocks(rank: int, cp: int, visible) -> set[tuple[int, int]]:
    """(query chunk, key chunk) blocks the rank's calls compute (a causal call: on or below its diagonal)."""
    mine, covered = chunk_ids(rank, cp), set()
    for step, calls in enumerate(ring_plan(rank, cp, visible=visible)):
        theirs = chunk_ids(ring_source(rank, step, cp), cp)
        for call in calls:
            for qi, ki in itertools.product(range(call.q_start, call.q_stop), range(call.kv_start, call.kv_stop)):
                if mine[qi] >= theirs[ki]:
                    covered.add((mine[qi], theirs[ki]))
                else:
                    assert call.causal, "a non-causal call over a future block"
    return covered

def test_documents_that_never_cross_a_chunk_edge_skip_every_full_block():
    cp = 2
    positions = torch.arange(CHUNK).repeat(2 * cp).expand(B, 2 * cp * CHUNK)  # one document per chunk
    visible = chunk_visibility(DocumentMask.from_position_ids(positions), cp)
    for rank in range(cp):
        assert rank_block_counts(rank, cp, visible=visible)[FULL] == 0
        assert [len(calls) for calls in ring_plan(rank, cp, visible=visible)] == [2, 0]  # two diagonal squares


@pytest.mark.parametrize("window", [None, 3])
def test_a_causal_calls_local_tables_are_the_dense_masks(window):
    """BlockMask.local (what the varlen kernels read for a rank's own chunks): key_start and query_end in
    the call's rows equal the first and one past the last visible pair of the dense block mask."""
    cp, s = 2, 4 * CHUNK
    mask = DocumentMask.from_position_ids(_positions(cp, True), window)
    for rank in range(cp):
        documents = RingDocuments(mask, rank, cp)
        rows = slice(0, 2 * CHUNK)
        block = documents.block_mask(rows, rows, rank)
        keep = block.keep(rows, rows)[:, 0, 0]  # [b, s/cp, s/cp]
        local = block.local()
        index = torch.arange(2 * CHUNK)
        first_key = torch.where(keep, index[None, None, :], s).amin(2)
        last_row = torch.where(keep, index[None, :, None], -1).amax(1)
        assert torch.equal(local.key_start.long(), first_key) and torch.equal(local.query_end.long(), last_row + 1)


@pytest.mark.parametrize("window, expected", [
    (None, (slice(4, 8), slice(5, 8), False)),  # rows of chunk 3 all see keys 9..11 of the crossing document
    (2, (slice(4, 5), slice(7, 8), False)),     # only token 12 sees key 11
    (3, (slice(4, 6), slice(6, 8), True)),      # tokens 12, 13 see keys 10..11 and 11: a mask inside the box
])
def test_a_full_call_is_cropped_to_its_visible_pairs(window, expected):
    """cp 2, documents [0, 1) [1, 6) [6, 9) [9, 16): rank 0 (chunks 0 and 3) against rank 1's K/V (chunks 1
    and 2): the full call of chunk 3's rows over both K/V chunks keeps the box of the pairs it sees."""
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS[2][0]])[None]
    documents = RingDocuments(DocumentMask.from_position_ids(positions, window), 0, 2)
    rows, cols, mask = documents.call(slice(4, 8), slice(0, 8), 1, causal=False)
    assert (rows, cols, mask is not None) == expected
    assert documents.call(slice(0, 4), slice(0, 8), 1, causal=False) is None  # chunk 0 sees none of them
