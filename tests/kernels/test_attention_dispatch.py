"""`auto` attention dispatch: the measured table decides, but never for a call an implementation
cannot serve (dropout needs megalite's Philox mask; enable_gqa needs a torch that has it; the
log-sum-exp entry points of ring attention are always the Triton kernels)."""
from types import SimpleNamespace

import pytest
import torch

from kernel_testing import DEVICE, requires_triton
from megalite.kernels import attention_block, attention_dispatch, attention_reference, flash_attention

TABLE = {("sm_90", 128, "bf16", True): {1024: dict(triton=1.0, sdpa=2.0, sdpa_gqa=1.5),
                                        8192: dict(triton=9.0, sdpa=7.0, sdpa_gqa=6.0)}}


@pytest.fixture
def measured(monkeypatch):
    monkeypatch.setattr(attention_dispatch, "MEASURED_MS", TABLE)
    monkeypatch.setattr(attention_dispatch, "cuda_arch", lambda index: "sm_90")
    attention_dispatch._auto.cache_clear()
    yield
    attention_dispatch._auto.cache_clear()


def _cuda_call(seq, heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16):
    """Stand-ins with a CUDA device and the shapes choose() reads (no GPU needed)."""
    q = SimpleNamespace(device=torch.device("cuda", 0), shape=(2, heads, seq, dim), dtype=dtype)
    k = SimpleNamespace(device=torch.device("cuda", 0), shape=(2, kv_heads, seq, dim), dtype=dtype)
    return q, k


def _choose(seq, dropout_p=0.0, backend="auto", **shape):
    q, k = _cuda_call(seq, **shape)
    return attention_dispatch.choose(q, k, True, dropout_p, backend, have_triton=True)[0]


def test_the_fastest_measured_implementation_at_the_nearest_length(measured, monkeypatch):
    monkeypatch.setattr(attention_dispatch, "SDPA_HAS_GQA", True)
    assert _choose(1024) == "triton"
    assert _choose(1500) == "triton"  # log2-nearer to 1024 than to 8192
    assert _choose(4096) == "sdpa_gqa"  # log2(4096) is nearer 8192 (1 octave) than 1024 (2)
    assert _choose(65536) == "sdpa_gqa"


def test_enable_gqa_is_never_picked_where_torch_lacks_it(measured, monkeypatch):
    monkeypatch.setattr(attention_dispatch, "SDPA_HAS_GQA", False)
    assert _choose(8192) == "sdpa"


def test_dropout_always_runs_the_triton_kernels(measured):
    assert _choose(8192, dropout_p=0.1) == "triton"


def test_unmeasured_shapes_get_sdpa_and_backends_force_their_choice(measured):
    assert _choose(8192, dim=64) == "sdpa"  # d=64 not measured on this GPU
    assert _choose(8192, dtype=torch.float16) == "sdpa"
    assert _choose(1024, backend="torch") == "reference"
    assert _choose(8192, backend="triton") == "triton"
    q = torch.randn(1, 2, 8, 16)
    assert attention_dispatch.choose(q, q, True, 0.0, "auto", have_triton=True)[0] == "reference"  # a CPU tensor


def test_the_banner_names_the_choice_and_its_measured_margin(measured, monkeypatch):
    monkeypatch.setattr(attention_dispatch, "SDPA_HAS_GQA", True)
    line = attention_dispatch.describe("sm_90", 128, torch.bfloat16, 8192, True, 0.0, True, "auto")
    assert line.startswith("attention: torch SDPA (enable_gqa)") and "megalite Triton kernels 1.50x its time" in line
    assert "megalite Triton kernels" in attention_dispatch.describe("sm_90", 128, torch.bfloat16, 8192, True, 0.1,
                                                                    True, "auto")
    # the name the planner counts activations for is the banner's choice
    assert attention_dispatch.implementation("sm_90", 128, torch.bfloat16, 8192, True, 0.0, True, "auto") == "sdpa_gqa"
    assert attention_dispatch.implementation("sm_90", 128, torch.bfloat16, 8192, True, 0.1, True, "auto") == "triton"


def test_the_model_names_the_attention_its_blocks_run_for_the_planner(measured, monkeypatch):
    from megalite.ops import attention_implementation

    from megalite.kernels import attention_tiles

    monkeypatch.setattr(attention_dispatch, "SDPA_HAS_GQA", True)
    monkeypatch.setattr(attention_tiles, "cuda_arch", lambda index: "sm_90")
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "auto")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = lambda device, cp=1, comm="p2p", seq=1024: attention_implementation(128, 32, 8, seq, "bf16", 0.0, cp, comm,
                                                                             device)
    assert (on(cuda), on(cuda, seq=8192), on(cuda, cp=2), on(cuda, 2, "a2a", 8192)) == \
        ("triton", "sdpa_gqa", "triton", "sdpa_gqa")              # ring attention runs Triton's blocks
    assert on(cpu) == "reference"
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    assert on(cpu) == "triton"


def test_every_table_row_names_known_implementations():
    for key, rows in attention_dispatch.MEASURED_MS.items():
        assert key[0].startswith("sm_") and key[2] in ("bf16", "fp16", "fp32"), key
        for seq, times in rows.items():
            assert seq > 0 and times and set(times) <= set(attention_dispatch.IMPLEMENTATIONS), (key, seq)
            assert all(ms > 0 for ms in times.values()), (key, seq)


@pytest.mark.parametrize("native_gqa", [False, True])
def test_the_sdpa_path_computes_the_reference(native_gqa):
    if native_gqa and not attention_dispatch.SDPA_HAS_GQA:
        pytest.skip("this torch's SDPA has no enable_gqa")
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    torch.testing.assert_close(attention_dispatch.sdpa(q, k, v, True, 0.3, native_gqa),
                               attention_reference(q, k, v, True, 0.3), atol=1e-6, rtol=1e-6)


@requires_triton
def test_the_lse_entry_points_never_consult_the_dispatch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ring attention's blocks must run the Triton kernels")
    monkeypatch.setattr(attention_dispatch, "choose", refuse)
    monkeypatch.setattr(flash_attention, "choose", refuse)  # flash_attention.attention's own reference to it
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    out, lse = attention_block.attention_forward_with_lse(q, k, v, True, 0.25)
    torch.testing.assert_close(out, attention_reference(q, k, v, True, 0.25), atol=2e-5, rtol=2e-5)
