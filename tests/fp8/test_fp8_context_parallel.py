"""FP8 under context parallelism: a cp rank's linears and experts see its share of each sequence's
tokens, so the tensorwise amaxes of x and g (and rowwise's weight-gradient amaxes, along the
tokens) are MAX-reduced over cp. Given the same inputs, each cp rank computes exactly the single
process's casts: outputs and input gradients equal its rows, weight gradients its sum (1e-6).

Whole training steps at cp 2 are compared in tests/fp8/test_fp8_parity.py (tensorwise); docs/fp8.md
says why a whole-step comparison can meet an FP8 rounding flip (fp32 noise in ring attention's
merge of the blocks) and how often it does.
"""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.fp8 import Fp8Recipe
from megalite.fp8.experts import fp8_experts_forward
from megalite.moe.experts import LocalExperts
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.testing import assert_tensor_close, run_distributed

RECIPES = (Fp8Recipe("hybrid", "tensorwise"), Fp8Recipe("e4m3", "rowwise"))


def _mlp(recipe, x, g, cp_group=None):
    torch.manual_seed(0)
    fc1, fc2 = ColumnParallelLinear(32, 64), RowParallelLinear(64, 32)
    for layer in (fc1, fc2):
        layer.fp8, layer.fp8_tokens = recipe, cp_group
    x = x.clone().requires_grad_()
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    y.backward(g)
    return [y.detach(), x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad]


def _experts(recipe, x, sizes, g, cp_group=None):
    experts = LocalExperts(32, 48, gated=True, expert_ids=range(3), base_seed=5, init_std=0.05, num_layers=2, tp_group=None)
    experts.fp8, experts.fp8_tokens = recipe, cp_group
    x = x.clone().requires_grad_()
    y = fp8_experts_forward(experts, x, torch.tensor(sizes))
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for e in experts.values() for p in (e.fc1_weight, e.fc2_weight)]


def _rank_rows(sizes_by_rank, rank):
    """Row indices, in the single process's expert-sorted order, of rank `rank`'s expert rows."""
    rows, start = [], 0
    for e in range(len(sizes_by_rank[0])):
        for r, sizes in enumerate(sizes_by_rank):
            if r == rank:
                rows += range(start, start + sizes[e])
            start += sizes[e]
    return torch.tensor(rows)


def _at_cp2(x, g, ex, eg, sizes_by_rank, references):
    m = mesh.init_mesh(cp=2)
    r = m.cp_rank
    for recipe, (mlp_ref, experts_ref) in zip(RECIPES, references):
        got = _mlp(recipe, x.chunk(2, 0)[r], g.chunk(2, 0)[r], m.cp_group)  # [s/cp, b, h] each
        for i, (a, b) in enumerate(zip(got, mlp_ref)):
            if i < 2:
                assert_tensor_close(a, b.chunk(2, 0)[r], rtol=1e-6, what=f"{recipe} mlp output {i}")
            else:  # weight gradients: partial over the tokens (the dp x cp reduction sums them)
                assert_tensor_close(comm.all_reduce(a.clone(), m.cp_group), b, rtol=1e-6, what=f"{recipe} mlp grad {i}")
        rows = _rank_rows(sizes_by_rank, r)
        got = _experts(recipe, ex[rows], sizes_by_rank[r], eg[rows], m.cp_group)
        for i, (a, b) in enumerate(zip(got, experts_ref)):
            expected = b[rows] if i < 2 else b
            a = a if i < 2 else comm.all_reduce(a.clone(), m.cp_group)
            assert_tensor_close(a, expected, rtol=1e-6, what=f"{recipe} experts output {i}")


def test_cp2_casts_what_the_single_process_casts():
    torch.manual_seed(4)
    # magnitudes rising along the sequence (and rank 1's expert rows 100x rank 0's): the two cp ranks'
    # amaxes lie binades apart, so a power-of-two scale from one rank's tokens alone casts other numbers
    ramp = torch.logspace(-1, 1, 8)[:, None, None]
    x, g = torch.randn(8, 2, 32) * ramp, torch.randn(8, 2, 32) * ramp  # [s, b, h]
    sizes_by_rank = [[3, 0, 5], [2, 4, 1]]  # rows each cp rank routes to the 3 experts
    total = sum(map(sum, sizes_by_rank))
    ex, eg = torch.randn(total, 32), torch.randn(total, 32)  # expert-sorted rows of both ranks
    ex[_rank_rows(sizes_by_rank, 1)] *= 100
    eg[_rank_rows(sizes_by_rank, 1)] *= 100
    sizes = [a + b for a, b in zip(*sizes_by_rank)]
    references = [(_mlp(recipe, x, g), _experts(recipe, ex, sizes, eg)) for recipe in RECIPES]
    run_distributed(_at_cp2, 2, x, g, ex, eg, sizes_by_rank, references)


def test_without_the_cp_reduction_the_casts_differ():
    """The test above can fail: a cp rank scaling by its own tokens' amax casts other numbers. (With
    power-of-two scales only where the range differs: a scale 2^k larger or smaller rounds normal
    numbers alike, so rank 0's tokens here are 1e4 times larger, pushing rank 1's into e4m3's
    subnormals under the whole tensor's scale.)"""
    torch.manual_seed(4)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    x[:4] *= 1e4  # cp rank 0's half holds the amax
    full = _mlp(RECIPES[0], x, g)
    half = _mlp(RECIPES[0], x[4:], g[4:])  # rank 1's tokens alone, no reduction
    assert not torch.equal(half[0], full[0][4:])
