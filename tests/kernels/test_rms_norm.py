"""RMSNorm kernels vs rms_norm_reference: odd hidden sizes, strided inputs, residual fusion, and
every launch configuration (tile rows, warps, persistent programs) computing the same."""
import importlib

import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, NORM_LAUNCH_CONFIGS, compare_with_reference, gpu_only, \
    requires_triton, tolerance
from megalite.kernels import rms_norm, rms_norm_reference, rms_norm_residual, rms_norm_residual_reference

rms_norm_module = importlib.import_module("megalite.kernels.rms_norm")

pytestmark = requires_triton


def strided_input(shape, dtype):
    """[a, b, n] viewed from a [b, a, n] buffer: rows are not contiguous in memory."""
    a, b, n = shape
    return torch.randn(b, a, n, device=DEVICE, dtype=dtype).transpose(0, 1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_matches_reference_on_strided_odd_rows(dtype):
    x = strided_input((5, 3, 100), dtype) * 3 + 1  # hidden 100: not a power of two; 15 rows > 4 programs
    weight = torch.randn(100, device=DEVICE, dtype=dtype)
    compare_with_reference(rms_norm, rms_norm_reference, [x, weight, ], tolerance(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_residual_returns_norm_of_sum_and_sum(dtype):
    x = strided_input((7, 2, 72), dtype)
    residual = torch.randn(7, 2, 72, device=DEVICE, dtype=dtype)
    weight = torch.randn(72, device=DEVICE, dtype=dtype)
    normed, summed = compare_with_reference(rms_norm_residual, rms_norm_residual_reference, [x, residual, weight],
                                            tolerance(dtype))
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)  # rounded exactly like torch's add


@pytest.mark.parametrize("config", NORM_LAUNCH_CONFIGS, ids=str)
def test_rms_norm_every_launch_config_matches_reference(config, monkeypatch):
    monkeypatch.setattr(rms_norm_module, "_forward_config", lambda n_cols, device: config)
    monkeypatch.setattr(rms_norm_module, "_backward_config", lambda n_cols, device: config)
    wide = torch.randn(15, 56, device=DEVICE)
    x = wide[:, 3:43]  # hidden 40, rows 56 apart: a row-strided view, read in place
    residual = torch.randn(15, 40, device=DEVICE)
    weight = torch.randn(40, device=DEVICE)
    compare_with_reference(rms_norm_residual, rms_norm_residual_reference, [x, residual, weight],
                           tolerance(torch.float32))
    compare_with_reference(rms_norm, rms_norm_reference, [x, weight], tolerance(torch.float32))


def test_rms_norm_backward_reads_row_strided_gradients_in_place():
    x, weight = torch.randn(15, 40, device=DEVICE), torch.randn(40, device=DEVICE)
    _, _, rstd = rms_norm_module._forward(x, None, weight, 1e-6)
    dy_wide, dsum_wide = torch.randn(15, 64, device=DEVICE), torch.randn(15, 48, device=DEVICE)
    dy, dsum = dy_wide[:, 5:45], dsum_wide[:, 8:]  # row strides 64 and 48
    dx, dweight = rms_norm_module._backward(dy, dsum, x, weight, rstd)
    dx_contiguous, dweight_contiguous = rms_norm_module._backward(dy.contiguous(), dsum.contiguous(), x, weight, rstd)
    # the same values, not the same bits: compiled Triton specialises on the stride (16-divisible or
    # not), which changes load vectorisation and the order of the row reductions
    torch.testing.assert_close(dx, dx_contiguous, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dweight, dweight_contiguous, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dweight, (dy * x * rstd[:, None]).sum(0), **tolerance(torch.float32))


def test_rms_norm_fp32_weight_with_half_input_and_eps():
    x = torch.randn(9, 48, device=DEVICE, dtype=torch.float16) * 1e-3  # eps matters at this scale
    weight = torch.randn(48, device=DEVICE)
    y = compare_with_reference(lambda a, w: rms_norm(a, w, eps=1e-5), lambda a, w: rms_norm_reference(a, w, 1e-5),
                               [x, weight], tolerance(torch.float16))
    assert y.dtype == torch.float16


def test_rms_norm_rejects_bad_input():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(4, 8, device=DEVICE), torch.ones(6, device=DEVICE))
    with pytest.raises(TypeError, match="supports float32, float16, bfloat16"):
        rms_norm(torch.randn(4, 8, device=DEVICE, dtype=torch.float64), torch.ones(8, device=DEVICE))


@gpu_only
def test_rms_norm_training_shape_bf16():
    x = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    compare_with_reference(rms_norm, rms_norm_reference, [x, weight], tolerance(torch.bfloat16, bf16=3e-2))
