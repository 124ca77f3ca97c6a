"""tanh-GeLU and bias-GeLU kernels vs F.gelu(approximate="tanh")."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import bias_gelu, bias_gelu_reference, gelu, gelu_reference

pytestmark = pytest.mark.filterwarnings("ignore:overflow")  # numpy exp in the interpreter's sigmoid


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gelu_matches_torch_tanh_gelu(dtype):
    # 3 * 7 * 150 = 3150 elements: not a multiple of the 1024-element block; strided view
    x = torch.randn(7, 3, 150, device=DEVICE, dtype=dtype).transpose(0, 1) * 4
    compare_with_reference(gelu, gelu_reference, [x], tolerance(dtype))


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bias_gelu_matches_gelu_of_sum(dtype):
    x = torch.randn(5, 9, 110, device=DEVICE, dtype=dtype) * 3
    bias = torch.randn(110, device=DEVICE, dtype=dtype)
    compare_with_reference(bias_gelu, bias_gelu_reference, [x, bias], tolerance(dtype),
                           grad_tol=tolerance(dtype, fp32=2e-5, fp16=4e-3))  # dbias sums 45 rows


@requires_triton
def test_gelu_tails_and_zero():
    x = torch.tensor([-30.0, -8.0, -1e-4, 0.0, 1e-4, 8.0, 30.0], device=DEVICE)
    compare_with_reference(gelu, gelu_reference, [x], tolerance(torch.float32))


def test_bias_gelu_rejects_wrong_bias():
    with pytest.raises(ValueError, match="bias has shape"):
        bias_gelu(torch.randn(3, 8, device=DEVICE), torch.zeros(3, device=DEVICE))
