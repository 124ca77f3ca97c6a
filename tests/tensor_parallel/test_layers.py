"""Column/Row/VocabParallel layers vs torch.nn at tp = 1, 2, 4: outputs and gradients."""
import pytest
import torch
from torch import nn

from megalite.parameters import params as P
from megalite.distributed import mesh
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      scatter_to_sequence_parallel_region)
from megalite.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _rows(t, tp, rank, dim=0):
    return t.chunk(tp, dim=dim)[rank]


def _check_layers(tp):
    m = mesh.init_mesh(tp=tp)
    r = m.tp_rank
    s, b, h, out = 8, 3, 12, 8
    x_full = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1))

    # ColumnParallelLinear == nn.Linear under the same seed; output shard = column slice.
    torch.manual_seed(0)
    ref = nn.Linear(h, out)
    torch.manual_seed(0)
    col = ColumnParallelLinear(h, out)
    assert col.weight.shape == (out // tp, h)
    _close(col.weight.data, _rows(ref.weight.data, tp, r), "column weight is a row slice")
    x_ref, x = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
    y_ref, y = ref(x_ref), col(x)
    _close(y, _rows(y_ref, tp, r, dim=-1), "column output")
    grad = torch.randn(s, b, out, generator=torch.Generator().manual_seed(2))
    y_ref.backward(grad)
    y.backward(_rows(grad, tp, r, dim=-1).contiguous())
    _close(x.grad, x_ref.grad, "column input grad (all-reduced)")
    _close(col.weight.grad, _rows(ref.weight.grad, tp, r), "column weight grad")
    _close(col.bias.grad, _rows(ref.bias.grad, tp, r), "column bias grad")

    # gather_output with fused blocks [Q; K; V] returns the full, block-major output.
    torch.manual_seed(0)
    ref = nn.Linear(h, 3 * out)
    torch.manual_seed(0)
    fused = ColumnParallelLinear(h, 3 * out, gather_output=True, fused_blocks=(out, out, out))
    for i in range(3):  # rank r holds [Q_r; K_r; V_r]
        local = fused.weight.data[i * out // tp:(i + 1) * out // tp]
        _close(local, _rows(ref.weight.data[i * out:(i + 1) * out], tp, r), f"fused block {i}")
    x_ref, x = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
    y_ref, y = ref(x_ref), fused(x)
    _close(y, y_ref, "fused column gathered output")
    y_ref.square().sum().backward()
    y.square().sum().backward()
    _close(x.grad, x_ref.grad, "fused column input grad")

    # RowParallelLinear: weight is the column slice; output reduced; bias added once.
    torch.manual_seed(0)
    ref = nn.Linear(out, h)
    torch.manual_seed(0)
    row = RowParallelLinear(out, h, input_is_parallel=False)
    _close(row.weight.data, _rows(ref.weight.data, tp, r, dim=1), "row weight is a column slice")
    z_full = torch.randn(s, b, out, generator=torch.Generator().manual_seed(3))
    z_ref, z = z_full.clone().requires_grad_(), z_full.clone().requires_grad_()
    y_ref, y = ref(z_ref), row(z)
    _close(y, y_ref, "row output")
    y_ref.square().sum().backward()
    y.square().sum().backward()
    _close(z.grad, z_ref.grad, "row input grad (gathered)")
    _close(row.weight.grad, _rows(ref.weight.grad, tp, r, dim=1), "row weight grad")
    _close(row.bias.grad, ref.bias.grad, "row bias grad")

    # Sequence parallel: column gathers the sequence, row reduce-scatters it.
    torch.manual_seed(0)
    ref_in, ref_out = nn.Linear(h, out), nn.Linear(out, h)
    torch.manual_seed(0)
    col_sp = ColumnParallelLinear(h, out, sequence_parallel=True)
    row_sp = RowParallelLinear(out, h, sequence_parallel=True)
    x_ref = x_full.clone().requires_grad_()
    x_shard = _rows(x_full, tp, r).clone().requires_grad_()  # [s/tp, b, h]
    y_ref = ref_out(torch.relu(ref_in(x_ref)))
    y = row_sp(torch.relu(col_sp(x_shard)))
    _close(y, _rows(y_ref, tp, r), "sequence-parallel output shard")
    y_ref.square().sum().backward()
    y.square().sum().backward()
    _close(x_shard.grad, _rows(x_ref.grad, tp, r), "sequence-parallel input grad shard")
    _close(col_sp.weight.grad, _rows(ref_in.weight.grad, tp, r), "SP column weight grad")
    assert P.is_sequence_parallel_grad(row_sp.bias)
    from megalite.distributed import comm
    bias_grad = comm.all_reduce(row_sp.bias.grad.clone(), m.tp_group)  # partial per rank under SP
    _close(bias_grad, ref_out.bias.grad, "SP row bias grad after tp all-reduce")

    # VocabParallelEmbedding, vocabulary not divisible by tp (padded, never refused).
    vocab = 10
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, h)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(vocab, h)
    ids = torch.tensor([[0, 9, 3, 5], [7, 1, 2, 8]])
    y_ref, y = ref(ids), emb(ids)
    _close(y, y_ref, "embedding output")
    y_ref.square().sum().backward()
    y.square().sum().backward()
    per_rank = emb.padded_num_embeddings // tp
    start = r * per_rank
    expected = torch.zeros(per_rank, h)
    real = max(0, min(per_rank, vocab - start))
    expected[:real] = ref.weight.grad[start:start + real]
    _close(emb.weight.grad, expected, "embedding weight grad (padding rows zero)")
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_match_torch_nn(tp):
    assert all(run_distributed(_check_layers, tp, tp))
