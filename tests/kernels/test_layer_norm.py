"""LayerNorm kernels vs layer_norm_reference: odd hidden sizes, strided inputs, residual fusion, and
every launch configuration (tile rows, warps, persistent programs) computing the same."""
import importlib

import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, NORM_LAUNCH_CONFIGS, compare_with_reference, requires_triton, \
    tolerance
from megalite.kernels import layer_norm, layer_norm_reference, layer_norm_residual, layer_norm_residual_reference

layer_norm_module = importlib.import_module("megalite.kernels.layer_norm")

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_matches_reference_on_strided_odd_rows(dtype):
    x = torch.randn(3, 5, 100, device=DEVICE, dtype=dtype).transpose(0, 1) * 2 + 0.5  # mean far from 0
    weight = torch.randn(100, device=DEVICE, dtype=dtype)
    bias = torch.randn(100, device=DEVICE, dtype=dtype)
    compare_with_reference(layer_norm, layer_norm_reference, [x, weight, bias], tolerance(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_residual_returns_norm_of_sum_and_sum(dtype):
    x = torch.randn(2, 7, 72, device=DEVICE, dtype=dtype).transpose(0, 1)
    residual = torch.randn(7, 2, 72, device=DEVICE, dtype=dtype)
    weight = torch.randn(72, device=DEVICE, dtype=dtype)
    bias = torch.randn(72, device=DEVICE, dtype=dtype)
    _, summed = compare_with_reference(layer_norm_residual, layer_norm_residual_reference,
                                       [x, residual, weight, bias], tolerance(dtype))
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)


@pytest.mark.parametrize("config", NORM_LAUNCH_CONFIGS, ids=str)
def test_layer_norm_every_launch_config_matches_reference(config, monkeypatch):
    monkeypatch.setattr(layer_norm_module, "_forward_config", lambda n_cols, device: config)
    monkeypatch.setattr(layer_norm_module, "_backward_config", lambda n_cols, device: config)
    wide = torch.randn(15, 56, device=DEVICE) + 0.5
    x = wide[:, 3:43]  # hidden 40, rows 56 apart: a row-strided view, read in place
    residual = torch.randn(15, 40, device=DEVICE)
    weight, bias = torch.randn(40, device=DEVICE), torch.randn(40, device=DEVICE)
    compare_with_reference(layer_norm_residual, layer_norm_residual_reference, [x, residual, weight, bias],
                           tolerance(torch.float32))
    compare_with_reference(layer_norm, layer_norm_reference, [x, weight, bias], tolerance(torch.float32))


def test_layer_norm_weight_and_bias_of_different_dtypes():
    # the weight and bias gradients come from one column-sum launch when their dtypes agree, two otherwise
    x = torch.randn(7, 72, device=DEVICE, dtype=torch.float16)
    weight, bias = torch.randn(72, device=DEVICE), torch.randn(72, device=DEVICE, dtype=torch.float16)
    compare_with_reference(layer_norm, layer_norm_reference, [x, weight, bias], tolerance(torch.float16))


def test_layer_norm_custom_eps_matters():
    # eps equal to the variance: it moves rstd by ~30%, so ignoring it (or using the default) fails.
    # LayerNorm(c x; c^2 eps) = LayerNorm(x; eps): this is the function of x * 1e-3 with eps = 1e-6,
    # at the conditioning where fp32 can meet 1e-5. At x ~ 1e-3 (rstd ~ 700) the input gradient's
    # near-zero elements carry ~ulp(700) = 6e-5 of rounding: over 20 draws on an H200 torch's own
    # CUDA LayerNorm missed a 1e-5 tolerance against float64 by up to 1.37x, ours (interpreted on
    # CPU) by 2.05x, so that version passed or failed with the random draw (docs/benchmarks.md).
    x = torch.randn(6, 40, device=DEVICE)
    weight, bias = torch.randn(40, device=DEVICE), torch.randn(40, device=DEVICE)
    compare_with_reference(lambda a, w, b: layer_norm(a, w, b, eps=1.0),
                           lambda a, w, b: layer_norm_reference(a, w, b, 1.0), [x, weight, bias],
                           tolerance(torch.float32))
    assert (layer_norm(x, weight, bias, eps=1.0) - layer_norm(x, weight, bias)).abs().max() > 0.1


def test_layer_norm_rejects_bad_input():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="bias has shape"):
        layer_norm(x, torch.ones(8, device=DEVICE), torch.zeros(7, device=DEVICE))
    with pytest.raises(TypeError, match="supports float32, float16, bfloat16"):
        layer_norm(x.double(), torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pytorch_path_keeps_the_input_in_its_dtype_and_fp32_statistics(dtype, monkeypatch):
    # what the kernels keep (2 bytes per element + 8 per row), not the reference's fp32 copy of x
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    x = torch.randn(6, 5, 48, dtype=dtype)
    weight, bias = torch.randn(48, dtype=dtype), torch.randn(48, dtype=dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer_norm(x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
            if t.untyped_storage().data_ptr() not in (weight.untyped_storage().data_ptr(),
                                                      bias.untyped_storage().data_ptr())}
    assert sum(kept.values()) == x.numel() * 2 + 30 * 8
    compare_with_reference(layer_norm, layer_norm_reference, [x.detach(), weight.detach(), bias.detach()],
                           tolerance(dtype, fp16=0.0, bf16=0.0), ref_dtype=None,
                           grad_tol=tolerance(dtype, fp16=2e-3, bf16=1.6e-2))
