"""Flash attention kernels vs scaled_dot_product_attention with k/v heads repeated."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, gpu_only, requires_triton, tolerance
from megalite.kernels import attention, attention_reference

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
