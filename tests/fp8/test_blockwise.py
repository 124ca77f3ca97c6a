"""--fp8-recipe blockwise (DeepSeek-V3's 1 x 128 / 128 x 128 scales) against references built here
tile by tile, and in training: it trains like fp32, and dp 2 / pp 2 give the single process's run."""
import pytest
import torch

from megalite.config import RunConfig
from megalite.fp8 import Fp8Recipe
from megalite.fp8.blockwise import dequantize, quantize_blocks
from megalite.fp8.linear import fp8_linear


def _tilewise(t, dtype, rows, cols):
    """Quantise-dequantise one tile at a time (power-of-two scales), loops and slices only."""
    out, limit = torch.empty_like(t), torch.finfo(dtype).max
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], cols):
            tile = t[i:i + rows, j:j + cols]
            scale = 2.0 ** torch.floor(torch.log2(limit / tile.abs().max().clamp(min=1e-12).double())).float()
            out[i:i + rows, j:j + cols] = (tile * scale).clamp(-limit, limit).to(dtype).float() / scale
    return out


@pytest.mark.parametrize("rows,cols", [(1, 128), (128, 128), (128, 1)])
def test_blocks_cast_tile_by_tile(rows, cols):
    torch.manual_seed(0)
    t = torch.randn(300, 200) * torch.logspace(-3, 3, 200)  # partial last tiles, a wide range per row
    q, inv = quantize_blocks(t, torch.float8_e4m3fn, rows, cols)
    assert inv.shape == (-(-300 // rows), -(-200 // cols))
    assert torch.equal(dequantize(q, inv, rows, cols), _tilewise(t, torch.float8_e4m3fn, rows, cols))


def test_blockwise_linear_matches_the_tilewise_reference():
    torch.manual_seed(1)
    r = Fp8Recipe("hybrid", "blockwise")
    x = torch.randn(5, 60, 192, requires_grad=True)  # [s, b, K]: 300 tokens, K over two tiles (128 + 64)
    w = torch.randn(160, 192, requires_grad=True)  # [N, K]
    b, g = torch.randn(160, requires_grad=True), torch.randn(5, 60, 160)
    y = fp8_linear(x, w, b, r)
    y.backward(g)
    x2, g2, wd = x.detach().reshape(-1, 192), g.reshape(-1, 160), w.detach()
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    y_ref = _tilewise(x2, e4, 1, 128) @ _tilewise(wd, e4, 128, 128).t() + b.detach()
    dx_ref = _tilewise(g2, e5, 1, 128) @ _tilewise(wd, e4, 128, 128)
    dw_ref = _tilewise(g2, e5, 128, 1).t() @ _tilewise(x2, e4, 128, 1)
    torch.testing.assert_close(y.detach().reshape(-1, 160), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 192), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, dw_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(b.grad, g2.sum(0))
    exact = x2 @ wd.t()
    assert (y.detach().reshape(-1, 160) - b.detach() - exact).norm() / exact.norm() < 0.05  # FP8, not more


def test_blockwise_is_refused_where_it_is_not_built():
    problems = RunConfig.build(tp=2, fp8_format="hybrid", fp8_recipe="blockwise").validate()
    assert len(problems) == 1 and problems[0].startswith("--fp8-recipe blockwise with --tp 2 --cp 1"), problems
    assert RunConfig.build(fp8_recipe="blockwise").validate() == ["--fp8-recipe blockwise needs --fp8-format e4m3|hybrid"]


def test_dp2_pp2_train_to_the_blockwise_single_process():
    """Every GEMM whole at dp 2 and pp 2: the single process's losses and weights (1e-5, 2 steps); the
    run differs from fp32, within 2%."""
    from test_fp8_parity import _cfg, _parallel, _reference, _run
    from megalite.distributed.mesh import single_process_mesh
    from megalite.testing import run_distributed

    ref = _reference("blockwise")
    fp32 = _run(single_process_mesh("cpu"), _cfg())[0]
    assert ref[0] != fp32
    torch.testing.assert_close(ref[0], fp32, rtol=0.02, atol=0)
    run_distributed(_parallel, 2, 1, 1, 2, {"fp8_recipe": "blockwise"}, *ref, timeout_s=240)
    run_distributed(_parallel, 2, 1, 2, 1, {"fp8_recipe": "blockwise"}, *ref, timeout_s=240)
