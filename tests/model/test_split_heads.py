"""ops.split_heads: the fused QKV output split into q, k, v head views whose backward
concatenates the three gradients in one copy, equal bit for bit to autograd's split + view."""
import torch

from megalite import ops


def test_split_heads_matches_split_and_view_forward_and_backward():
    s, b, d, heads = 5, 3, 4, (4, 2, 2)  # grouped-query: 4 query heads, 2 kv groups
    qkv = torch.randn(s, b, sum(heads) * d, dtype=torch.float64, requires_grad=True)
    # the attention kernel's gradients come back [b, h, s, d] and are permuted to [s, b, h, d]:
    # not contiguous, which is what made autograd's view backward copy each one
    grads = [torch.randn(b, n, s, d, dtype=torch.float64).permute(2, 0, 1, 3) for n in heads]

    ours = ops.split_heads(qkv, heads, d)
    torch.autograd.backward(ours, grads)
    ours_grad, qkv.grad = qkv.grad, None
    blocks = qkv.split([n * d for n in heads], dim=-1)
    theirs = [t.view(s, b, n, d) for t, n in zip(blocks, heads)]
    torch.autograd.backward(theirs, grads)

    for mine, reference in zip(ours, theirs):
        assert mine.shape == reference.shape and torch.equal(mine, reference)
        assert mine.data_ptr() == reference.data_ptr() and mine.stride() == reference.stride()  # views, no copy
    assert torch.equal(ours_grad, qkv.grad) and ours_grad.is_contiguous()
    # an unused output contributes zeros (as autograd's split does)
    qkv.grad = None
    q, k, v = ops.split_heads(qkv, heads, d)
    (q * 2).sum().backward()
    assert torch.equal(qkv.grad[..., heads[0] * d:], torch.zeros(s, b, (heads[1] + heads[2]) * d, dtype=torch.float64))
