"""Ring attention and Ulysses on real gloo rings (cp = 2, 4) against plain causal attention.

Every rank computes the full-sequence reference itself (same seed), runs context-parallel
attention on its zigzag chunks, and gathers outputs and input gradients back into sequence
order. Grouped-query attention (8 query heads over 4 kv heads) throughout; the diagonal
blocks are every rank's step 0. Also checked here: the ledger's bytes per call against the
formulas in ring.py / ulysses.py, that a transfer is posted before the step's attention
runs, and the attention work each rank really computes (equal under zigzag, not under a
contiguous split).
"""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.context_parallel import (causal_work, gather_sequence, rank_block_counts, ring_attention, ring_plan,
                                       split_sequence, ulysses_attention)
from megalite.context_parallel import ring as ring_module
from megalite.kernels import attention_reference
from megalite.testing import run_distributed

B, H, H_KV, D, CHUNK = 2, 8, 4, 8, 4  # each rank holds 2 chunks of CHUNK tokens


def _full_inputs(cp):
    gen = torch.Generator().manual_seed(0)
    s = 2 * cp * CHUNK
    q, k, v = (torch.randn(B, heads, s, D, generator=gen) for heads in (H, H_KV, H_KV))
    return q, k, v, torch.randn(B, H, s, D, generator=gen)


def _reference(q, k, v, grad_out):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention_reference(*leaves, causal=True)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _instrument(log: list, chunk: int):
    """Record the ring's events: posted transfers, waits, and each attention call's work."""
    originals = (ring_module.block_forward, ring_module.block_backward, comm.batch_isend_irecv, comm.wait_all)

    def work(q, k, causal):
        return q.shape[2] * k.shape[2] / chunk ** 2 / (2 if causal else 1)

    def forward(q, k, v, causal, scale, mask=None):
        log.append(("forward", work(q, k, causal)))
        return originals[0](q, k, v, causal, scale, mask)

    def backward(q, k, v, out, dout, lse, causal, scale, mask=None):
        log.append(("backward", work(q, k, causal)))
        return originals[1](q, k, v, out, dout, lse, causal, scale, mask)

    def post(transfers, group):
        log.append(("post", 0))
        return originals[2](transfers, group)

    def wait(handles):
        log.append(("wait", 0))
        return originals[3](handles)

    ring_module.block_forward, ring_module.block_backward = forward, backward
    comm.batch_isend_irecv, comm.wait_all = post, wait


def _run(attention, m, layout, log=None):
    """(max abs errors of out, dq, dk, dv vs the reference; bytes of forward; of backward; calls of both)."""
    q, k, v, grad_out = _full_inputs(m.cp_size)
    expected = _reference(q, k, v, grad_out)
    local = [split_sequence(t, m.cp_rank, m.cp_size, dim=2, layout=layout).requires_grad_(True) for t in (q, k, v)]
    comm.ledger.reset()
    out = attention(*local, m.cp_group, layout=layout)
    forward_bytes = dict(comm.ledger.bytes)
    if log is not None:
        log.append(("end of forward", 0))
    out.backward(split_sequence(grad_out, m.cp_rank, m.cp_size, dim=2, layout=layout))
    backward_bytes = {key: n - forward_bytes.get(key, 0) for key, n in comm.ledger.bytes.items()}
    calls = dict(comm.ledger.calls)
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local], expected):
        pieces = comm.all_gather(mine.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        errors.append((gather_sequence(list(pieces), dim=2, layout=layout) - full).abs().max().item())
    return errors, forward_bytes, backward_bytes, calls


def _rank_checks(cp):
    m = mesh.init_mesh(cp=cp)
    results = {"ring": _run(ring_attention, m, "zigzag"), "ulysses": _run(ulysses_attention, m, "zigzag"),
               "ulysses contiguous": _run(ulysses_attention, m, "contiguous")}
    log: list = []
    _instrument(log, CHUNK)  # from here on, this rank's ring records what it does
    for layout in ("zigzag", "contiguous"):
        log.clear()
        results[f"ring {layout}"] = _run(ring_attention, m, layout, log)
        results[f"log {layout}"] = list(log)
    q, k, v, _ = _full_inputs(cp)
    try:  # 3 query heads over 1 kv head cannot be split 2 or 4 ways: refused before any all-to-all
        ulysses_attention(q[:, :3], k[:, :1], v[:, :1], m.cp_group)
        results["refusal"] = None
    except ValueError as exc:
        results["refusal"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def world(request):
    """(cp, every rank's results): one started world per cp size serves every test below."""
    return request.param, run_distributed(_rank_checks, request.param, request.param)


ATTENTIONS = ["ring", "ulysses", "ulysses contiguous", "ring zigzag", "ring contiguous"]


def test_context_parallel_attention_equals_plain_causal_attention(world):
    cp, ranks = world
    for rank, results in enumerate(ranks):
        for name in ATTENTIONS:
            errors = results[name][0]
            assert max(errors) < 1e-5, f"cp={cp} rank {rank} {name}: max |error| of out, dq, dk, dv = {errors}"


def test_ledger_bytes_per_call_match_the_formulas(world):
    """ring: forward (cp-1) K/V messages of 2*b*h_kv*(s/cp)*d*4 bytes each way; backward the same
    plus cp fp32 dK/dV messages. Ulysses: forward one all-to-all of (h + 2 h_kv)*b*(s/cp)*d*4
    bytes and one of h*b*(s/cp)*d*4; backward the same two."""
    cp, ranks = world
    local = B * (2 * CHUNK) * D * 4  # one head of this rank's tokens, fp32 bytes
    kv = 2 * H_KV * local
    for results in ranks:
        _, forward, backward, calls = results["ring"]
        assert forward == {("cp", "send"): (cp - 1) * kv, ("cp", "recv"): (cp - 1) * kv}
        assert backward == {("cp", "send"): (2 * cp - 1) * kv, ("cp", "recv"): (2 * cp - 1) * kv}
        assert calls == {("cp", "send"): 3 * cp - 2, ("cp", "recv"): 3 * cp - 2}
        _, forward, backward, calls = results["ulysses"]
        assert forward == backward == {("cp", "all_to_all"): (H + 2 * H_KV) * local + H * local}
        assert calls == {("cp", "all_to_all"): 4}, "2 all-to-alls forward, 2 backward"


def test_each_transfer_is_posted_before_the_step_computes(world):
    cp, ranks = world
    for rank, results in enumerate(ranks):
        for layout in ("zigzag", "contiguous"):
            log = results[f"log {layout}"]
            forward = log[:log.index(("end of forward", 0))]
            expected = []
            for step, calls in enumerate(ring_plan(rank, cp, layout)):
                last = step == cp - 1
                expected += ([] if last else [("post", 0)]) + [("forward", c.work()) for c in calls] + \
                    ([] if last else [("wait", 0)])
            assert forward == expected, f"rank {rank} {layout}"


def test_zigzag_balances_the_attention_work_ranks_really_compute(world):
    cp, ranks = world
    for layout in ("zigzag", "contiguous"):
        done = []
        for rank, results in enumerate(ranks):
            log = results[f"log {layout}"]
            forward = sum(w for kind, w in log if kind == "forward")
            backward = sum(w for kind, w in log if kind == "backward")
            assert forward == backward == causal_work(rank_block_counts(rank, cp, layout)), (rank, layout)
            done.append(forward)
        if layout == "zigzag":
            assert done == [done[0]] * cp == [2.0 * cp] * cp, done
        else:
            assert done == [4 * r + 2 for r in range(cp)], done  # the plain split: rank cp-1 does 2cp-1 times more


def test_ulysses_refuses_heads_it_cannot_split(world):
    cp, ranks = world
    for results in ranks:
        assert results["refusal"] is not None
        assert f"3 query heads and 1 kv heads must both divide by cp={cp}" in results["refusal"]
        assert "--cp-comm-type p2p" in results["refusal"]
