"""SwiGLU kernels vs silu(gate) * up."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import swiglu, swiglu_reference

pytestmark = pytest.mark.filterwarnings("ignore:overflow")  # numpy exp in the interpreter's sigmoid


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_swiglu_matches_reference_on_strided_halves(dtype):
    # gate and up as the two halves of one fused [tokens, 2 * 173] projection: strided views
    fused = torch.randn(3, 7, 2 * 173, device=DEVICE, dtype=dtype) * 3
    gate, up = fused[..., :173], fused[..., 173:]
    compare_with_reference(swiglu, swiglu_reference, [gate, up], tolerance(dtype))


@requires_triton
def test_swiglu_is_silu_times_up():
    gate, up = torch.randn(2, 33, device=DEVICE), torch.randn(2, 33, device=DEVICE)
    torch.testing.assert_close(swiglu(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="same shape and dtype"):
        swiglu(torch.randn(3, 8, device=DEVICE), torch.randn(3, 9, device=DEVICE))
