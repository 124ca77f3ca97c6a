"""Flash attention kernels vs scaled_dot_product_attention with k/v heads repeated."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, gpu_only, requires_triton, tolerance
from megalite.kernels import attention, attention_reference
from megalite.kernels.attention_torch import attention_keep_mask

pytestmark = requires_triton


def qkv(batch, heads, kv_heads, seq, dim, dtype):
    # q as the transpose of a [b, s, h, d] projection output: strided, like the model's
    q = torch.randn(batch, seq, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, seq, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, device=DEVICE, dtype=dtype)
    return q, k, v


# Half-precision kernels are compared with the float32 reference: their error is rounding of
# p and of the inputs of each dot (about 1e-3 relative), far below a wrong mask or scale.
HALF_TOL = dict(fp16=1e-2, bf16=4e-2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention_matches_reference(dtype, causal):
    # seq 37: not a multiple of the 16-row blocks; 4 query heads share 2 kv heads
    q, k, v = qkv(2, 4, 2, 37, 32, dtype)
    compare_with_reference(lambda *t: attention(*t, causal=causal), lambda *t: attention_reference(*t, causal=causal),
                           [q, k, v], tolerance(dtype, fp32=2e-5, **HALF_TOL), ref_dtype=torch.float32)


def test_head_dim_64_custom_scale_multi_query_whole_blocks():
    q, k, v = qkv(1, 3, 1, 32, 64, torch.float32)  # one kv head for three query heads; seq = 2 whole blocks
    compare_with_reference(lambda *t: attention(*t, causal=False, softmax_scale=0.3),
                           lambda *t: attention_reference(*t, causal=False, softmax_scale=0.3), [q, k, v],
                           tolerance(torch.float32, fp32=2e-5))


@pytest.mark.parametrize("dim", [8, 40])
def test_head_dims_between_the_native_ones_are_zero_padded(dim):
    q, k, v = qkv(1, 2, 1, 19, dim, torch.float32)
    compare_with_reference(attention, attention_reference, [q, k, v], tolerance(torch.float32, fp32=2e-5))


def test_model_layout_output_is_written_and_its_gradient_read_in_place():
    """q, k, v as the block makes them ([b, h, s, d] views of one [s, b, heads, d] QKV output): the
    output comes back laid out as [s, b, h, d], so the block's permute back is a view, and its
    gradient arrives through that view (strided); both directions match the reference."""
    seq, batch, heads, kv_heads, dim = 19, 2, 4, 2, 16
    qkv_out = torch.randn(seq, batch, heads + 2 * kv_heads, dim, device=DEVICE, requires_grad=True)
    ref_in = qkv_out.detach().clone().requires_grad_()

    def core(x, fn):  # [s, b, heads, d] -> the block's [s, b, h*d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in x.split([heads, kv_heads, kv_heads], dim=2))
        out = fn(q, k, v, causal=True)
        return out, out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    out, flat = core(qkv_out, attention)
    assert out.permute(2, 0, 1, 3).is_contiguous()                  # written as [s, b, h, d]: no copy back
    assert flat.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    expected = core(ref_in, attention_reference)[1]
    torch.testing.assert_close(flat, expected, atol=2e-5, rtol=2e-5)
    grad = torch.randn_like(flat)
    flat.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(qkv_out.grad, ref_in.grad, atol=2e-5, rtol=2e-5)


def test_attention_rejects_unsupported_inputs():
    q, k, v = qkv(1, 2, 2, 8, 160, torch.float32)
    with pytest.raises(ValueError, match="head dim 160 is not supported.*1 to 128"):
        attention(q, k, v)
    q, k, v = qkv(1, 2, 2, 8, 32, torch.float64)
    with pytest.raises(TypeError, match="supports float32, float16, bfloat16"):
        attention(q, k, v)
    q, k, v = qkv(1, 3, 2, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        attention(q, k, v)


@gpu_only
@pytest.mark.parametrize("dim", [64, 128])
def test_long_sequence_bf16(dim):
    q, k, v = qkv(1, 8, 2, 2049, dim, torch.bfloat16)
    compare_with_reference(attention, attention_reference, [q, k, v], tolerance(torch.bfloat16, bf16=4e-2),
                           ref_dtype=torch.float32)


def test_non_causal_kv_length_differs_from_q_length():
    q, _, _ = qkv(2, 4, 2, 13, 16, torch.float32)
    _, k, v = qkv(2, 4, 2, 21, 16, torch.float32)
    compare_with_reference(lambda *t: attention(*t, causal=False), lambda *t: attention_reference(*t, causal=False),
                           [q, k, v], tolerance(torch.float32, fp32=2e-5))


def test_blocks_with_lse_merge_and_differentiate_like_the_whole_row():
    """The ring-attention contract: queries of chunk 1 over a full block (chunk 0) and the diagonal
    (chunk 1), each computed apart; merged by log-sum-exp; backward per block from the row's out/lse."""
    from megalite.kernels import attention_backward_with_lse, attention_forward_with_lse

    chunk, dim = 19, 8  # odd rows crossing 16-row tiles; head dim zero-padded to 16
    q_all, k, v = qkv(2, 4, 2, 2 * chunk, dim, torch.float32)
    leaves = [t.detach().requires_grad_(True) for t in (q_all, k, v)]
    expected = attention_reference(*leaves, causal=True)[:, :, chunk:]  # the reference: whole rows
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    q, scale = q_all[:, :, chunk:], dim ** -0.5

    blocks = [(slice(0, chunk), False), (slice(chunk, 2 * chunk), True)]
    parts = [attention_forward_with_lse(q, k[:, :, keys], v[:, :, keys], causal, scale) for keys, causal in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(part_lse - lse).unsqueeze(-1) for o, part_lse in parts)
    torch.testing.assert_close(out, expected.detach(), atol=2e-5, rtol=2e-5)
    scores = q @ k.repeat_interleave(2, dim=1)[:, :, :chunk].transpose(-1, -2) * scale
    torch.testing.assert_close(parts[0][1], torch.logsumexp(scores, -1), atol=2e-5, rtol=2e-5)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys, causal in blocks:
        dq_b, dk_b, dv_b = attention_backward_with_lse(q, k[:, :, keys], v[:, :, keys], out, grad_out, lse, causal,
                                                       scale)
        dq += dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    for name, got, want in (("dq", dq, leaves[0].grad[:, :, chunk:]), ("dk", dk, leaves[1].grad),
                            ("dv", dv, leaves[2].grad)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)


# --- dropout: Philox masks regenerated in backward ---------------------------------------------
SEED, OFFSET = 2 ** 60 + 99, 2 ** 32 - 300  # mask counters cross the 2^32 boundary


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_dropout_matches_reference(dtype, causal):
    # seq 20 across two 16-row blocks; 2 query heads share 1 kv head
    q, k, v = qkv(1, 2, 1, 20, 16, dtype)
    compare_with_reference(lambda *t: attention(*t, causal=causal, dropout_p=0.2, dropout_seed=SEED,
                                                dropout_offset=OFFSET),
                           lambda *t: attention_reference(*t, causal=causal, dropout_p=0.2, dropout_seed=SEED,
                                                          dropout_offset=OFFSET),
                           [q, k, v], tolerance(dtype, fp32=2e-5, **HALF_TOL), ref_dtype=torch.float32)


def test_dropout_mask_is_the_philox_mask_of_each_head_slice():
    # q = k = 0: uniform probabilities 1/s; v = identity: out[b, h, i, j] = keep[b, h, i, j] / ((1 - p) s)
    b, h, s, p = 2, 3, 16, 0.5
    q = torch.zeros(b, h, s, 16, device=DEVICE)
    v = torch.eye(16, device=DEVICE).expand(b, h, s, 16).contiguous()
    out = attention(q, q, v, causal=False, dropout_p=p, dropout_seed=SEED, dropout_offset=OFFSET)
    keep = attention_keep_mask(SEED, OFFSET, b, h, s, p, DEVICE)
    assert torch.equal(out != 0, keep)
    torch.testing.assert_close(out[keep], torch.full_like(out[keep], 1 / ((1 - p) * s)))
    # a tensor-parallel rank holding heads [1, 3) passes offset + 1*b*s*s and gets those heads' mask
    rank_part = attention_keep_mask(SEED, OFFSET + 1 * b * s * s, b, 2, s, p, DEVICE)
    assert torch.equal(rank_part, keep[:, 1:])


def test_dropout_pytorch_path_matches_reference_and_keeps_nothing_per_score(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, 24, 8, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attention(q, k, v, dropout_p=0.3, dropout_seed=SEED, dropout_offset=OFFSET)
    # q, k, v, the output and a float32 log-sum-exp per row; nothing of size s x s
    assert sorted(t.numel() for t in saved) == sorted([q.numel(), k.numel(), v.numel(), q.numel(), 2 * 4 * 24])
    compare_with_reference(lambda *t: attention(*t, dropout_p=0.3, dropout_seed=SEED, dropout_offset=OFFSET),
                           lambda *t: attention_reference(*t, dropout_p=0.3, dropout_seed=SEED,
                                                          dropout_offset=OFFSET),
                           [q.detach(), k.detach(), v.detach()], tolerance(torch.float32, fp32=2e-5))
