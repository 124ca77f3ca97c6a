"""Ring attention and Ulysses with query/key heads wider than the values (multi-head latent attention:
d_qk 24, d_v 16 here, DeepSeek's 192 / 128) on a real 2-rank gloo ring, against plain causal attention
over the whole sequence with the same softmax scale: outputs and q, k, v gradients, and the bytes the
ledger counts per call against the formulas in ring.py / ulysses.py with each tensor's own head dim."""
import torch

from megalite.distributed import comm, mesh
from megalite.context_parallel import gather_sequence, ring_attention, split_sequence, ulysses_attention
from megalite.testing import run_distributed

B, H, CHUNK, D_QK, D_V, SCALE = 2, 4, 4, 24, 16, 0.37


def _inputs(cp: int, kv_heads: int):
    gen = torch.Generator().manual_seed(1)
    s = 2 * cp * CHUNK
    q = torch.randn(B, H, s, D_QK, generator=gen)
    k = torch.randn(B, kv_heads, s, D_QK, generator=gen)
    v = torch.randn(B, kv_heads, s, D_V, generator=gen)
    return q, k, v, torch.randn(B, H, s, D_V, generator=gen)


def _reference(q, k, v, grad_out):
    """Causal attention in float64: q [b, h, s, d_qk], k [b, h_kv, s, d_qk], v [b, h_kv, s, d_v]."""
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    scores = leaves[0] @ keys.transpose(-1, -2) * SCALE
    scores = scores.masked_fill(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values
    out.backward(grad_out.double())
    return [out.detach()] + [t.grad for t in leaves]


def _check(m, attention, kv_heads):
    q, k, v, grad_out = _inputs(m.cp_size, kv_heads)
    expected = _reference(q, k, v, grad_out)
    local = [split_sequence(t, m.cp_rank, m.cp_size, dim=2).requires_grad_(True) for t in (q, k, v)]
    comm.ledger.reset()
    out = attention(*local, m.cp_group, softmax_scale=SCALE)
    assert out.shape == (B, H, 2 * CHUNK, D_V)
    forward_bytes = dict(comm.ledger.bytes)
    out.backward(split_sequence(grad_out, m.cp_rank, m.cp_size, dim=2))
    backward_bytes = {key: n - forward_bytes.get(key, 0) for key, n in comm.ledger.bytes.items()}
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local], expected):
        pieces = comm.all_gather(mine.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        whole = gather_sequence(list(pieces), dim=2)
        errors.append(((whole.double() - full).abs().max() / full.abs().max()).item())
    return errors, forward_bytes, backward_bytes


def _world():
    m = mesh.init_mesh(cp=2)
    return {"ring": _check(m, ring_attention, kv_heads=2),  # grouped: 4 query heads over 2 kv heads
            "ulysses": _check(m, ulysses_attention, kv_heads=H)}


def test_ring_and_ulysses_take_narrower_values_exactly():
    tokens, elt = 2 * CHUNK, 4
    for rank in run_distributed(_world, 2):
        errors, forward, backward = rank["ring"]
        assert max(errors) < 1e-5, errors  # out, dq, dk, dv relative to their largest entry
        message = B * 2 * tokens * (D_QK + D_V)  # one [b, h_kv, s/cp, d_qk + d_v] K/V message
        assert forward == {("cp", "send"): message * elt, ("cp", "recv"): message * elt}
        assert backward == {("cp", "send"): 3 * message * elt, ("cp", "recv"): 3 * message * elt}  # K/V, then 2 fp32 dK/dV
        errors, forward, backward = rank["ulysses"]
        assert max(errors) < 1e-5, errors
        inputs, output = B * tokens * H * (2 * D_QK + D_V), B * tokens * H * D_V
        assert forward == {("cp", "all_to_all"): (inputs + output) * elt} == backward
