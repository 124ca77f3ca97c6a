"""RoPE kernels vs the HF-Llama rotate-half formula."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import rope, rope_reference

pytestmark = requires_triton


def rotary_tables(seq: int, dim: int, base: float = 10000.0):
    """cos, sin [seq, dim] with halves duplicated, built as HF Llama builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEVICE) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=DEVICE), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rope_matches_reference_on_a_slice_of_fused_qkv(dtype):
    seq, batch, heads, dim = 7, 3, 5, 24  # 5 heads and half-dim 12: neither a power of two
    qkv = torch.randn(seq, batch, heads, 3 * dim, device=DEVICE, dtype=dtype)
    k = qkv[..., dim:2 * dim]  # strided view
    cos, sin = rotary_tables(seq, dim)
    compare_with_reference(lambda x: rope(x, cos.to(dtype), sin.to(dtype)),
                           lambda x: rope_reference(x, cos.to(dtype), sin.to(dtype)), [k], tolerance(dtype))


def test_rope_equals_hf_formula_and_position_zero_is_identity():
    seq, batch, heads, dim = 5, 2, 3, 16
    x = torch.randn(seq, batch, heads, dim, device=DEVICE)
    cos, sin = rotary_tables(seq, dim)
    expected = x * cos[:, None, None, :] + hf_rotate_half(x) * sin[:, None, None, :]
    out = rope(x, cos, sin)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0], x[0], atol=0, rtol=0)


def test_rope_accepts_megatron_table_layout_and_rejects_wrong_tables():
    x = torch.randn(4, 1, 2, 8, device=DEVICE)
    cos, sin = rotary_tables(4, 8)
    torch.testing.assert_close(rope(x, cos[:, None, None, :], sin[:, None, None, :]), rope(x, cos, sin))
    with pytest.raises(ValueError, match="expected \\[4, 8\\]"):
        rope(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="even head dim"):
        rope(torch.randn(4, 1, 2, 7, device=DEVICE), cos, sin)


def test_rope_with_a_table_per_sample_rotates_each_sample_by_its_own_positions():
    """Packed documents: [s, b, d] tables, gathered by each sample's restarting positions; forward and
    backward equal each sample rotated alone by its rows of the shared table."""
    seq, batch, heads, dim = 9, 2, 3, 16
    cos, sin = rotary_tables(seq, dim)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))], device=DEVICE)  # [b, s]
    per_cos, per_sin = cos[position_ids].transpose(0, 1), sin[position_ids].transpose(0, 1)  # [s, b, d]
    x = torch.randn(seq, batch, heads, dim, device=DEVICE, requires_grad=True)
    out = rope(x, per_cos, per_sin)
    for b in range(batch):
        alone = rope_reference(x[:, b:b + 1].detach(), cos[position_ids[b]], sin[position_ids[b]])
        torch.testing.assert_close(out[:, b:b + 1], alone, atol=1e-6, rtol=1e-6)
    compare_with_reference(lambda t: rope(t, per_cos, per_sin), lambda t: rope_reference(t, per_cos, per_sin), [x],
                           tolerance(torch.float32))
