"""Grouped GEMM: the reference against dense masked matmuls, the kernels against the reference."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, gpu_only, leaf, requires_triton, tolerance
from megalite.kernels import grouped_mm, grouped_mm_grads, grouped_mm_reference


def _masked_dense(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """sum_g [row in g] * (x @ weight[g]): every group's matmul on every row, masked."""
    group_of_row = torch.repeat_interleave(torch.arange(weight.shape[0], device=x.device), group_sizes)
    every = torch.einsum("tk,ekn->etn", x, weight)  # [E, T, N]
    return every[group_of_row, torch.arange(x.shape[0], device=x.device)]


def test_reference_is_the_masked_dense_product_with_empty_groups():
    group_sizes = torch.tensor([3, 0, 5, 0, 1], device=DEVICE)
    x = torch.randn(9, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 6, 4, device=DEVICE, dtype=torch.float64, requires_grad=True)
    y = grouped_mm_reference(x, weight, group_sizes)
    torch.testing.assert_close(y, _masked_dense(x, weight, group_sizes))
    y.sum().backward()
    assert weight.grad[1].abs().sum() == 0 and weight.grad[3].abs().sum() == 0
    torch.testing.assert_close(weight.grad[2], x[3:8].detach().T @ torch.ones(5, 4, dtype=torch.float64))


def test_rejects_malformed_inputs():
    x, weight = torch.randn(4, 6, device=DEVICE), torch.randn(2, 6, 3, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        grouped_mm(x, weight, torch.tensor([2, 2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[experts, K, N\]"):
        grouped_mm(x, weight[:, :5], torch.tensor([2, 2], device=DEVICE))


def _compare(dtype, sizes, k, n, weight_stored_transposed=False):
    group_sizes = torch.tensor(sizes, dtype=torch.int64, device=DEVICE)
    x = torch.randn(sum(sizes), k, device=DEVICE, dtype=dtype)
    weight = torch.randn(len(sizes), k, n, device=DEVICE, dtype=dtype) / k ** 0.5
    if weight_stored_transposed:  # [E, N, K] storage (nn.Linear's [out, in]) seen as [E, K, N]
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
        assert weight.stride(1) == 1

    def op(fn):
        return lambda x, weight: fn(x, weight, group_sizes)

    compare_with_reference(op(grouped_mm), op(grouped_mm_reference), [x, weight], tolerance(dtype),
                           ref_dtype=torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sizes, k", [((5, 0, 17, 0, 1, 33), 40), ((0, 53, 0, 0), 48)],
                         ids=["empty_groups", "one_group"])
def test_grouped_mm_matches_reference(dtype, sizes, k):
    """Forward, dx and dweight, with groups of no rows (their dweight is zero, not unwritten), groups
    spanning several row tiles, K with and without a partial last block, odd N (masked column
    tiles). On CPU (16-row tiles, column sweeps of 2 row tiles): 7 and 4 row tiles, so sweeps both
    full and partial."""
    _compare(dtype, sizes, k, n=24)


@requires_triton
def test_grouped_mm_with_the_hopper_tiles(monkeypatch):
    """The sm_90 16-bit launch configuration itself (128x128x64 tiles, sweeps of 8 row tiles), fp16
    on CPU: one group larger than a tile, one smaller, one empty; N past one column tile; the
    weight stored [E, N, K] and passed as its transposed view (the kernels read it by strides)."""
    from megalite.kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "gemm_tiles", lambda device, dtype: grouped_gemm.TILES[(9, True)])
    _compare(torch.float16, (150, 0, 7), k=64, n=136, weight_stored_transposed=True)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=requires_triton), "torch"])
def test_grads_are_the_autograd_backward_bit_for_bit(backend, monkeypatch):
    """grouped_mm_grads (the experts' own autograd node calls it: megalite/moe/expert_gemm.py) gives
    grouped_mm's backward exactly, on the Triton path and on the reference path; an empty group's
    dweight is zero; what is not asked for is None."""
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
    group_sizes = torch.tensor([5, 0, 20, 1], device=DEVICE)
    x = torch.randn(26, 24, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 24, 18, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(26, 18, device=DEVICE, dtype=torch.bfloat16)
    grouped_mm(x, weight, group_sizes).backward(dy)
    dx, dweight = grouped_mm_grads(x.detach(), weight.detach(), group_sizes, dy)
    torch.testing.assert_close(dx, x.grad, atol=0, rtol=0)
    torch.testing.assert_close(dweight, weight.grad, atol=0, rtol=0)
    assert dweight[1].abs().sum() == 0
    assert grouped_mm_grads(x.detach(), weight.detach(), group_sizes, dy, need_dweight=False)[1] is None


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_at_a_training_shape_on_the_gpu(dtype):
    """The compiled kernels with their real tiles: many row tiles (sweeps of 8), skewed groups with
    zeros and single rows, K a whole number of blocks."""
    _compare(dtype, (0, 1000, 3, 0, 129, 2000, 1, 963), k=256, n=384)


@gpu_only
def test_grouped_mm_forward_and_backward_capture_in_a_cuda_graph():
    """No host synchronisation: forward, dx and dweight replay from a CUDA graph, and the replay
    follows new group sizes written into the same tensor."""
    group_sizes = torch.tensor([300, 0, 212, 500], device=DEVICE)
    x = torch.randn(1012, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 128, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1012, 256, device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        grouped_mm(x, weight, group_sizes).backward(dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x.grad = weight.grad = None
    with torch.cuda.graph(graph):
        y = grouped_mm(x, weight, group_sizes)
        y.backward(dy)
    group_sizes.copy_(torch.tensor([12, 700, 0, 300], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    x_ref, weight_ref = leaf(x), leaf(weight)
    y_ref = grouped_mm_reference(x_ref, weight_ref, group_sizes)
    y_ref.backward(dy)
    for got, want in ((y, y_ref), (x.grad, x_ref.grad), (weight.grad, weight_ref.grad)):
        torch.testing.assert_close(got.float(), want.float(), **tolerance(torch.bfloat16))
