"""MoE token permutation: the references against a plain loop, the kernels against the references."""
import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, gpu_only, requires_triton, tolerance
from megalite.kernels import (permute_tokens, permute_tokens_reference, unpermute_tokens,
                              unpermute_tokens_reference)


def _loop_permutation(expert_ids: torch.Tensor, num_experts: int) -> list[int]:
    """The flat slots (token * k + slot) in expert order, ties by flat index: by hand."""
    flat = expert_ids.reshape(-1).tolist()
    return [i for e in range(num_experts) for i, chosen in enumerate(flat) if chosen == e]


def _routing(tokens: int, top_k: int, num_experts: int, dropped: int = 0, seed: int = 0) -> torch.Tensor:
    """Distinct top-k expert ids per token (as topk gives), `dropped` slots set to -1."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=generator).topk(top_k, dim=1).indices
    drop = torch.randperm(tokens * top_k, generator=generator)[:dropped]
    ids.view(-1)[drop] = -1
    return ids.to(DEVICE)


def test_reference_permutation_is_the_stable_expert_order():
    ids = torch.tensor([[2, 0], [0, -1], [2, 1], [-1, 0]], device=DEVICE)  # expert 3 gets nothing
    x = torch.arange(4.0, device=DEVICE)[:, None].repeat(1, 3)
    permuted, sorted_index, group_sizes = permute_tokens_reference(x, ids, num_experts=4)
    assert sorted_index.tolist() == [1, 2, 7, 5, 0, 4] == _loop_permutation(ids, 4)
    assert group_sizes.tolist() == [3, 1, 2, 0]
    assert permuted[:, 0].tolist() == [0.0, 1.0, 3.0, 2.0, 0.0, 2.0]


def test_reference_unpermute_is_the_weighted_sum_per_token():
    ids = _routing(tokens=7, top_k=3, num_experts=5, dropped=4)
    x = torch.randn(7, 6, device=DEVICE, dtype=torch.float64)
    weights = torch.rand(7, 3, device=DEVICE, dtype=torch.float64)
    permuted, sorted_index, _ = permute_tokens_reference(x, ids, 5)
    out = unpermute_tokens_reference(permuted * 2, sorted_index, weights, 7)
    routed = (ids >= 0).to(torch.float64)
    torch.testing.assert_close(out, 2 * x * (weights * routed).sum(1, keepdim=True))


def test_rejects_malformed_inputs():
    with pytest.raises(TypeError, match="int64"):
        permute_tokens(torch.randn(3, 4, device=DEVICE), torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match=r"\[tokens, k\]"):
        permute_tokens(torch.randn(3, 4, device=DEVICE), torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), 2)


def _compare_moves(dtype, ids, num_experts, hidden):
    """permute_tokens and unpermute_tokens each against its reference, forward and backward (x; y and
    the weights). Each on its own: glue between them would round in the tested dtype and blur what
    the kernels compute."""
    tokens, top_k = ids.shape
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)

    def permute(fn):
        def run(x):
            permuted, sorted_index, group_sizes = fn(x, ids, num_experts)
            assert sorted_index.tolist() == _loop_permutation(ids, num_experts)
            assert group_sizes.tolist() == [int((ids == e).sum()) for e in range(num_experts)]
            return permuted
        return run

    compare_with_reference(permute(permute_tokens), permute(permute_tokens_reference), [x], tolerance(dtype),
                           ref_dtype=torch.float32)
    _, sorted_index, _ = permute_tokens_reference(x, ids, num_experts)
    y = torch.randn(sorted_index.numel(), hidden, device=DEVICE, dtype=dtype)
    weights = torch.rand(tokens, top_k, device=DEVICE, dtype=torch.float32)

    def unpermute(fn):
        return lambda y, weights: fn(y, sorted_index, weights, tokens)

    compare_with_reference(unpermute(unpermute_tokens), unpermute(unpermute_tokens_reference), [y, weights],
                           tolerance(dtype), ref_dtype=torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", ["spread", "one_expert", "dropped"])
def test_permute_and_unpermute_match_references(dtype, case):
    """Forward and backward of permute and of unpermute (x, y and the weights' gradients), with an
    expert that receives nothing (6 experts, ids from 5), every token on one expert, dropped slots
    and a token with none routed. Poisoned outputs: a row the kernels forget is NaN."""
    tokens, top_k, num_experts, hidden = 11, 2, 6, 40
    if case == "one_expert":
        ids = torch.full((tokens, top_k), -1, dtype=torch.int64, device=DEVICE)
        ids[:, 0] = 4
    else:
        ids = _routing(tokens, top_k, num_experts - 1, dropped=5 if case == "dropped" else 0, seed=1)
        if case == "dropped":
            ids[3] = -1  # a token routed nowhere: zeros out, zero gradients
    _compare_moves(dtype, ids, num_experts, hidden)


@gpu_only
def test_permute_and_unpermute_at_a_training_hidden_size_on_the_gpu():
    """1024-wide blocks over hidden 4096 (four per row), top-2 over 8 experts, bf16."""
    _compare_moves(torch.bfloat16, _routing(tokens=1000, top_k=2, num_experts=8, dropped=37), 8, 4096)


@requires_triton
def test_nothing_routed_gives_no_rows_zero_output_and_zero_gradients():
    ids = torch.full((3, 2), -1, dtype=torch.int64, device=DEVICE)
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    weights = torch.rand(3, 2, device=DEVICE, requires_grad=True)
    permuted, sorted_index, group_sizes = permute_tokens(x, ids, 4)
    assert permuted.shape == (0, 8) and sorted_index.numel() == 0 and group_sizes.tolist() == [0, 0, 0, 0]
    out = unpermute_tokens(permuted, sorted_index, weights, 3)
    assert out.shape == (3, 8) and out.abs().sum() == 0
    out.sum().backward()
    assert x.grad.abs().sum() == 0 and weights.grad.abs().sum() == 0


def test_model_functional_entry_points_dispatch_to_the_moe_ops(monkeypatch):
    """megalite.ops' grouped_mm / permute_tokens / unpermute_tokens are the kernels'
    ops (here under MEGALITE_KERNEL_BACKEND=torch: the references)."""
    from megalite.kernels import grouped_mm_reference
    from megalite import ops

    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    ids = _routing(tokens=5, top_k=2, num_experts=3, dropped=2)
    x, weights = torch.randn(5, 8, device=DEVICE), torch.rand(5, 2, device=DEVICE)
    weight = torch.randn(3, 8, 4, device=DEVICE)
    permuted, sorted_index, group_sizes = ops.permute_tokens(x, ids, 3)
    expected = permute_tokens_reference(x, ids, 3)
    for got, want in zip((permuted, sorted_index, group_sizes), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    y = ops.grouped_mm(permuted, weight, group_sizes)
    torch.testing.assert_close(y, grouped_mm_reference(permuted, weight, group_sizes), atol=0, rtol=0)
    torch.testing.assert_close(ops.unpermute_tokens(y, sorted_index, weights, 5),
                               unpermute_tokens_reference(y, sorted_index, weights, 5), atol=0, rtol=0)
