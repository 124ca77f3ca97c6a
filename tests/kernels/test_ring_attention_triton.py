"""Ring attention with its per-block attention in the Triton kernels (interpreted on CPU), cp = 2.

The other ring tests run the PyTorch block path; this one forks two gloo ranks that inherit
this directory's MEGALITE_KERNEL_BACKEND=triton (and TRITON_INTERPRET=1), so every block of
the ring goes through `attention_forward_with_lse` / `attention_backward_with_lse`. With packed
documents (and a window) a rank's own chunks (the causal calls) run the varlen kernels with the
mask in their own rows, full blocks cropped to a wholly visible box the plain kernels, and the
other masked full blocks the PyTorch block code.
"""
import pytest
import torch

from kernel_testing import ON_GPU, requires_triton
from megalite.distributed import comm, mesh
from megalite.context_parallel import block_attention, gather_sequence, ring_attention, split_sequence
from megalite.kernels import DocumentMask, attention_reference
from megalite.kernels.attention_documents import attention_documents_reference
from megalite.testing import run_distributed

pytestmark = [requires_triton,
              pytest.mark.skipif(ON_GPU, reason="forks CPU gloo ranks; on a GPU the block kernels are tested directly")]


def _ring_on_triton_blocks():
    m = mesh.init_mesh(cp=2)
    gen = torch.Generator().manual_seed(0)
    chunk = 5  # odd: rows and keys end inside the 16-wide tiles
    q, k, v = (torch.randn(1, heads, 4 * chunk, 8, generator=gen) for heads in (4, 2, 2))
    grad_out = torch.randn(1, 4, 4 * chunk, 8, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention_reference(*leaves, causal=True).backward(grad_out)
    calls = []
    for name in ("attention_forward_with_lse", "attention_backward_with_lse"):
        kernel = getattr(block_attention, name)
        setattr(block_attention, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    local = [split_sequence(t, m.cp_rank, 2, dim=2).requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*local, m.cp_group)
    out.backward(split_sequence(grad_out, m.cp_rank, 2, dim=2))
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local],
                          [attention_reference(q, k, v, causal=True)] + [t.grad for t in leaves]):
        pieces = comm.all_gather(mine.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        errors.append((gather_sequence(list(pieces), dim=2) - full).abs().max().item())
    return errors, calls


def test_ring_attention_on_the_triton_block_kernels():
    for errors, calls in run_distributed(_ring_on_triton_blocks, 2):
        assert calls == ["attention_forward_with_lse"] * 2 + ["attention_backward_with_lse"] * 2
        assert max(errors) < 2e-5, errors


def _ring_documents_on_triton_blocks(window):
    m = mesh.init_mesh(cp=2)
    gen = torch.Generator().manual_seed(0)
    chunk = 5  # chunks [0, 5), [5, 10), [10, 15), [15, 20): documents cross every edge
    q, k, v = (torch.randn(1, heads, 4 * chunk, 8, generator=gen) for heads in (4, 2, 2))
    grad_out = torch.randn(1, 4, 4 * chunk, 8, generator=gen)
    positions = torch.cat([torch.arange(n) for n in (1, 6, 4, 9)])[None]
    documents = DocumentMask.from_position_ids(positions, window)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = attention_documents_reference(*leaves, documents)
    expected.backward(grad_out)
    calls = []
    for name in ("attention_forward_with_lse", "attention_backward_with_lse"):
        kernel = getattr(block_attention, name)
        setattr(block_attention, name, lambda *a, kernel=kernel, name=name: calls.append((name, a[-1] is not None))
                or kernel(*a))
    local = [split_sequence(t, m.cp_rank, 2, dim=2).requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*local, m.cp_group, documents=documents)
    out.backward(split_sequence(grad_out, m.cp_rank, 2, dim=2))
    errors = []
    for mine, full in zip([out.detach()] + [t.grad for t in local], [expected.detach()] + [t.grad for t in leaves]):
        pieces = comm.all_gather(mine.unsqueeze(0).contiguous(), m.cp_group, dim=0).unbind(0)
        errors.append((gather_sequence(list(pieces), dim=2) - full).abs().max().item())
    return errors, calls


# slow (~6 s of interpreter each on a loaded machine): the quick tier checks BlockMask.local's tables
# (tests/context_parallel/test_ring_documents.py) and the varlen kernels (test_flash_attention_documents.py)
@pytest.mark.slow
@pytest.mark.parametrize("window", [3, None])
def test_ring_attention_with_documents_on_the_varlen_kernels(window):
    for errors, calls in run_distributed(_ring_documents_on_triton_blocks, 2, window):
        assert any(masked for _, masked in calls), calls  # the causal calls, with their mask (cropped full
        # blocks that every row of the crop sees whole run without one)
        assert [name for name, _ in calls].count("attention_forward_with_lse") == \
            [name for name, _ in calls].count("attention_backward_with_lse")
        assert max(errors) < 2e-5, errors
