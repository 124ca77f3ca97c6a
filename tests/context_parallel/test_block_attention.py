"""One block's attention with its log-sum-exp, merged blocks, and per-block backward (PyTorch path).

The oracle: causal attention over the whole row (scaled_dot_product_attention, k/v heads
repeated). The Triton kernels' version of the same contract is tested in tests/kernels.
"""
import math

import torch

from megalite.context_parallel.block_attention import block_backward, block_forward, merge_block
from megalite.kernels import attention_reference


def _inputs(b=2, h=4, h_kv=2, chunk=5, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, chunk, d, generator=gen)
    k, v = (torch.randn(b, h_kv, 2 * chunk, d, generator=gen) for _ in range(2))
    return q, k, v


def test_block_lse_is_the_rows_logsumexp():
    q, k, v = _inputs()
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = block_forward(q, k, v, causal=False, softmax_scale=scale)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * scale
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=False), rtol=1e-6, atol=1e-6)


def test_two_blocks_merged_and_differentiated_apart_equal_the_whole_row():
    # Queries are chunk 1 of a sequence; keys chunk 0 (a full block) and chunk 1 (the diagonal).
    q, k, v = _inputs()
    chunk, scale = q.shape[2], 1 / math.sqrt(q.shape[-1])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    # Reference: causal attention over both chunks as queries, keeping the second chunk's rows.
    q_all = torch.cat([torch.zeros_like(q), q], dim=2).requires_grad_(True)
    k_ref, v_ref = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
    expected = attention_reference(q_all, k_ref, v_ref, causal=True)[:, :, chunk:]
    expected.backward(grad_out)

    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    blocks = [(slice(0, chunk), False), (slice(chunk, 2 * chunk), True)]
    for keys, causal in reversed(blocks):  # merge order does not matter
        merge_block(out, lse, *block_forward(q, k[:, :, keys], v[:, :, keys], causal, scale))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys, causal in blocks:  # each block on its own, from the row's final out and lse
        dq_b, dk_b, dv_b = block_backward(q, k[:, :, keys], v[:, :, keys], out, grad_out, lse, causal, scale)
        dq += dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    torch.testing.assert_close(dq, q_all.grad[:, :, chunk:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, k_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv, v_ref.grad, rtol=1e-5, atol=1e-6)


def test_row_tiles_give_the_whole_blocks_result(monkeypatch):
    """The PyTorch path's query-row tiles (bounded fp32 scores) change nothing: tiles of 3 rows
    (a partial one at the end) against one tile, causal diagonal and full block, forward and
    backward; the tiled causal output is causal attention itself."""
    from megalite.context_parallel import block_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, 11, 8, generator=gen) for heads in (4, 2, 2))
    dout = torch.randn(q.shape, generator=gen)
    for causal in (True, False):
        whole = block_forward(q, k, v, causal, 0.3)
        whole_grads = block_backward(q, k, v, whole[0], dout, whole[1], causal, 0.3)
        monkeypatch.setattr(block_attention, "_ROWS", 3)
        tiled = block_forward(q, k, v, causal, 0.3)
        tiled_grads = block_backward(q, k, v, tiled[0], dout, tiled[1], causal, 0.3)
        if causal:
            torch.testing.assert_close(block_forward(q, k, v, True, 8 ** -0.5)[0],
                                       attention_reference(q, k, v, causal=True), rtol=1e-5, atol=1e-6)
        monkeypatch.undo()
        for got, want in zip(tiled + tiled_grads, whole + whole_grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
