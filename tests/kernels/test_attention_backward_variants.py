"""The two attention backward variants (kernels/flash_attention_backward.py): "split" (a dK/dV launch,
then a dQ launch) and "fused" (both kinds of program in one grid; 16-bit inputs only, float32 runs
split). Under the interpreter the fused one matches the float32 reference (fp16 stands in for bf16:
numpy has no bf16 dot; causal and not, GQA, head dims 64 and 128, odd lengths, dropout), gives the
split one's gradients bit for bit (the same programs, another grid), serves ring attention's
log-sum-exp entry point, and MEGALITE_ATTENTION_BACKWARD picks which kernels launch."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import attention, attention_reference, attention_tiles, flash_attention_backward

pytestmark = requires_triton
HALF_TOL = dict(fp16=1e-2, bf16=4e-2)  # rounding of p and the dots' inputs (test_flash_attention.py)
HALF = [dtype for dtype in FLOAT_DTYPES if dtype != torch.float32]


def qkv(heads, kv_heads, seq, dim, dtype, batch=1):
    q = torch.randn(batch, seq, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)  # strided, like the model's
    return q, *(torch.randn(batch, kv_heads, seq, dim, device=DEVICE, dtype=dtype) for _ in range(2))


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv(attention_tiles.BACKWARD_ENV, "fused")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_backward_matches_reference_gqa_odd_length(fused, dtype, causal):
    q, k, v = qkv(4, 2, 37, 16, dtype)  # 37: a tail block in every program; 2 query heads per kv head
    compare_with_reference(lambda *t: attention(*t, causal=causal), lambda *t: attention_reference(*t, causal=causal),
                           [q, k, v], tolerance(dtype, fp32=2e-5, **HALF_TOL), ref_dtype=torch.float32)


@pytest.mark.parametrize("dim, seq, causal", [(64, 32, True), (128, 21, False)])  # whole blocks / a tail
def test_fused_backward_head_dims_64_and_128(fused, dim, seq, causal):
    q, k, v = qkv(3, 1, seq, dim, torch.float16)
    compare_with_reference(lambda *t: attention(*t, causal=causal), lambda *t: attention_reference(*t, causal=causal),
                           [q, k, v], tolerance(torch.float16, **HALF_TOL), ref_dtype=torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_backward_regenerates_the_dropout_mask(fused, causal):
    extra = dict(dropout_p=0.25, dropout_seed=2 ** 60 + 99, dropout_offset=2 ** 32 - 300)  # counters cross 2^32
    q, k, v = qkv(2, 1, 20, 16, torch.float16)
    compare_with_reference(lambda *t: attention(*t, causal=causal, **extra),
                           lambda *t: attention_reference(*t, causal=causal, **extra), [q, k, v],
                           tolerance(torch.float16, **HALF_TOL), ref_dtype=torch.float32)


def _gradients(monkeypatch, variant, q, k, v, causal, **extra):
    monkeypatch.setenv(attention_tiles.BACKWARD_ENV, variant)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves, causal=causal, **extra).backward(torch.ones_like(q))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal, dropout", [(True, False), (False, True)])
def test_fused_and_split_give_the_same_gradients_bit_for_bit(monkeypatch, causal, dropout):
    q, k, v = qkv(4, 2, 21, 16, torch.float16)
    extra = dict(dropout_p=0.3, dropout_seed=5, dropout_offset=9) if dropout else {}
    split = _gradients(monkeypatch, "split", q, k, v, causal, **extra)
    fused = _gradients(monkeypatch, "fused", q, k, v, causal, **extra)
    for name, a, b in zip("qkv", split, fused):
        assert torch.equal(a, b), f"d{name} differs between the backward variants"


def test_ring_attention_block_backward_runs_the_fused_variant(monkeypatch):
    from megalite.kernels import attention_backward_with_lse, attention_forward_with_lse

    q, _, _ = qkv(2, 1, 19, 16, torch.float16, batch=2)
    _, k, v = qkv(2, 1, 37, 16, torch.float16, batch=2)  # a key block longer than the queries: more dK/dV programs
    out, lse = attention_forward_with_lse(q, k, v, False, 0.25)
    dout = torch.randn_like(out)
    grads = {}
    for variant in attention_tiles.BACKWARDS:
        monkeypatch.setenv(attention_tiles.BACKWARD_ENV, variant)
        grads[variant] = attention_backward_with_lse(q, k, v, out, dout, lse, False, 0.25)
    for a, b in zip(grads["split"], grads["fused"]):
        assert torch.equal(a, b)


def test_the_variable_picks_the_kernels_that_launch(monkeypatch):
    launched = []
    real = flash_attention_backward.runnable
    monkeypatch.setattr(flash_attention_backward, "runnable",
                        lambda kernel, device: launched.append(kernel.__name__) or real(kernel, device))
    half, single = (qkv(2, 1, 16, 16, dtype) for dtype in (torch.float16, torch.float32))
    for variant in ("split", "fused"):
        _gradients(monkeypatch, variant, *half, True)
    _gradients(monkeypatch, "fused", *single, True)  # float32 runs the split backward whatever is asked
    split = ["_attention_delta_kernel", "_attention_dkdv_kernel", "_attention_dq_kernel"]
    assert launched == split + ["_attention_delta_kernel", "_attention_backward_fused_kernel"] + split


def test_an_unknown_variant_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(attention_tiles.BACKWARD_ENV, "atomic")
    with pytest.raises(ValueError, match=r"MEGALITE_ATTENTION_BACKWARD='atomic'.*\('split', 'fused'\)"):
        attention_tiles.forced_backward()


def test_unmeasured_keys_run_the_split_backward_and_the_fused_launch_rule():
    assert attention_tiles.backward_for(torch.device("cpu"), 128, torch.bfloat16, True, False) == "split"
    tiles = dict(fwd=(64, 64, 4, 3), dkdv=(32, 64, 4, 3), dq=(64, 32, 8, 3))
    assert attention_tiles.fused_launch(tiles) == (8, 2)  # the more warps, at most 2 stages
