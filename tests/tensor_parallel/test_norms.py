"""Sequence-parallel norms for a user's model: the modules, the declaration, and DataParallel's refusal."""
import pytest
import torch
from torch import nn

from megalite.parameters import params
from megalite.data_parallel import DataParallel
from megalite.errors import UsageError
from megalite.layout import Layout
from megalite.distributed.mesh import Mesh
from megalite.tensor_parallel import (ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear,
                                      mark_sequence_parallel, unmarked_norm_problem)


def _tp2_mesh() -> Mesh:  # the refusal is decided before any collective: a mesh without groups suffices
    return Mesh(rank=0, layout=Layout(tp=2), tp_rank=0, pp_rank=0, dp_rank=0, device=torch.device("cpu"), backend=None)


class UserBlock(nn.Module):
    def __init__(self, norm: nn.Module, sequence_parallel: bool = True):
        super().__init__()
        self.norm = norm
        self.up = ColumnParallelLinear(8, 16, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(16, 8, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return x + self.down(self.up(self.norm(x)))


def test_dataparallel_refuses_an_undeclared_norm_among_sequence_parallel_layers():
    with pytest.raises(UsageError) as refused:
        DataParallel(UserBlock(nn.LayerNorm(8)), _tp2_mesh())
    message = str(refused.value)
    assert "norm (LayerNorm)" in message and "tensor_parallel.LayerNorm(..., sequence_parallel=True)" in message
    assert "mark_sequence_parallel(module)" in message and "\n" not in message
    rms = type("MyRMSNorm", (nn.Module,), {})()  # a user's own norm class, recognised by its name
    rms.weight = nn.Parameter(torch.ones(8))
    assert "tensor_parallel.RMSNorm" in unmarked_norm_problem([UserBlock(rms)], 2)
    megatron_style = nn.LayerNorm(8)
    megatron_style.weight.sequence_parallel = megatron_style.bias.sequence_parallel = True  # silently ignored before
    assert "`sequence_parallel` attribute is not read" in unmarked_norm_problem([UserBlock(megatron_style)], 2)


@pytest.mark.parametrize("declared", ["module", "marked", "marked_full"])
def test_declared_norms_pass(declared):
    norm = {"module": lambda: LayerNorm(8, sequence_parallel=True),
            "marked": lambda: mark_sequence_parallel(nn.LayerNorm(8)),
            "marked_full": lambda: mark_sequence_parallel(nn.LayerNorm(8), False)}[declared]()
    assert unmarked_norm_problem([UserBlock(norm)], 2) is None
    assert all(params.is_sequence_parallel_grad(p) == (declared != "marked_full") for p in norm.parameters())


def test_no_refusal_without_sequence_parallel_layers_or_at_tp1():
    assert unmarked_norm_problem([UserBlock(nn.LayerNorm(8), sequence_parallel=False)], 2) is None
    assert unmarked_norm_problem([UserBlock(nn.LayerNorm(8))], 1) is None


def test_norm_modules_equal_torch_forward_and_backward():
    x = torch.randn(5, 3, 8, requires_grad=True)
    for ours, theirs in ((LayerNorm(8, eps=1e-5), nn.LayerNorm(8, eps=1e-5)),
                         (RMSNorm(8, eps=1e-6), nn.RMSNorm(8, eps=1e-6))):
        with torch.no_grad():
            for p, q in zip(ours.parameters(), theirs.parameters()):
                p.uniform_(0.5, 1.5), q.copy_(p)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
        (ours(x) * x).sum().backward()
        (theirs(x) * x).sum().backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
