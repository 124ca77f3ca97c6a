"""The attention tile tables: every entry keeps the kernels' tile constraints, computes the
reference's attention under the interpreter, and compiles for its architecture without spills;
the kernels stay right at tile shapes the interpreter's default (16 x 16) never uses."""
import os
import subprocess
import sys

import pytest
import torch

from kernel_testing import DEVICE, ON_GPU, compare_with_reference, requires_triton, tolerance
from megalite.kernels import HAVE_TRITON, attention, attention_reference, attention_tiles, flash_attention

pytestmark = requires_triton
SAFE = [((None, d, dtype, causal, dropout), attention_tiles.safe_tiles(d, dtype, dropout, causal))
        for d in (16, 32, 64, 128) for dtype in (torch.bfloat16, torch.float32) for causal in (True, False)
        for dropout in (False, True)]
ENTRIES = list(attention_tiles.MEASURED.items()) + SAFE


def _is_tile_size(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


@pytest.mark.parametrize("key, tiles", ENTRIES, ids=[str(k) for k, _ in ENTRIES])
def test_every_entry_keeps_the_tile_constraints(key, tiles):
    assert set(tiles) == set(attention_tiles.KERNELS)
    for kernel, (block_m, block_n, warps, stages) in tiles.items():
        assert _is_tile_size(block_m) and _is_tile_size(block_n), (kernel, tiles[kernel])
        assert warps in (1, 2, 4, 8, 16) and 1 <= stages <= 6, (kernel, tiles[kernel])
    assert tiles["fwd"][0] % tiles["fwd"][1] == 0, "the forward's unmasked stage ends on a BLOCK_N boundary"


def _with_tiles(monkeypatch, tiles):
    monkeypatch.setattr(flash_attention, "_config", lambda head_dim, device, dtype, dropout=False, causal=True: dict(
        tiles, precision="ieee" if dtype == torch.float32 else "tf32"))


def _qkv(seq, dim, dtype):
    q = torch.randn(1, seq, 2, dim, device=DEVICE, dtype=dtype).transpose(1, 2)  # strided like the model's
    return q, torch.randn(1, 1, seq, dim, device=DEVICE, dtype=dtype), torch.randn(1, 1, seq, dim, device=DEVICE,
                                                                                  dtype=dtype)


@pytest.mark.parametrize("key, tiles", attention_tiles.MEASURED.items(), ids=[str(k) for k in attention_tiles.MEASURED])
def test_every_measured_entry_computes_the_reference(key, tiles, monkeypatch):
    """Interpreter (fp16 stands in for bf16: numpy has no bf16 dot): one length of whole blocks,
    one that ends mid-block, both crossing several blocks of the entry's largest tile."""
    _, head_dim, _, causal, dropout = key
    _with_tiles(monkeypatch, tiles)
    biggest = max(max(t[:2]) for t in tiles.values())
    extra = dict(dropout_p=0.2, dropout_seed=7, dropout_offset=3) if dropout else {}
    for seq in (2 * biggest, 2 * biggest + 3):
        compare_with_reference(lambda *t: attention(*t, causal=causal, **extra),
                               lambda *t: attention_reference(*t, causal=causal, **extra), list(_qkv(seq, head_dim,
                                                                                                      torch.float16)),
                               tolerance(torch.float16, fp16=1e-2), ref_dtype=torch.float32)


TILE_SHAPES = [dict(fwd=(32, 16, 1, 1), dkdv=(16, 32, 1, 1), dq=(32, 16, 1, 1)),
               dict(fwd=(16, 16, 1, 1), dkdv=(32, 16, 1, 1), dq=(16, 32, 1, 1))]


@pytest.mark.parametrize("tiles", TILE_SHAPES, ids=["m>n fwd dq, n>m dkdv", "m>n dkdv, n>m dq"])
@pytest.mark.parametrize("causal, dropout", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("seq", [64, 37])  # whole blocks (EVEN_M/EVEN_N), and a tail in every kernel
def test_backward_kernels_at_unequal_block_sizes(tiles, causal, dropout, seq, monkeypatch):
    """The causal start/diagonal arithmetic and the unmasked phases hold when BLOCK_M != BLOCK_N."""
    _with_tiles(monkeypatch, tiles)
    extra = dict(dropout_p=0.3, dropout_seed=11, dropout_offset=5) if dropout else {}
    compare_with_reference(lambda *t: attention(*t, causal=causal, **extra),
                           lambda *t: attention_reference(*t, causal=causal, **extra),
                           list(_qkv(seq, 16, torch.float32)), tolerance(torch.float32, fp32=2e-5))


def _has_cuda_backend() -> bool:
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.slow  # ~9 s on 2 cores: a subprocess compiles every measured entry, the fused backward's too
@pytest.mark.skipif(not HAVE_TRITON or not _has_cuda_backend() or ON_GPU, reason="needs triton's NVIDIA backend")
def test_every_measured_entry_compiles_for_its_architecture_without_spills(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-W", "ignore", "-m", "megalite.kernels.compile_tiles"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(" ok ") == 4 * len(attention_tiles.MEASURED), result.stdout  # 3 kernels, fused bwd
