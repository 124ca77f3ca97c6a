"""Library misuse that used to change a result without a word (issue 40) now stops with a message
naming the fix: a second init_mesh of another layout, tensor-parallel layers built before
init_mesh under a multi-rank launch, an id outside VocabParallelEmbedding's vocabulary, a bare
module given to DistributedOptimizer, and a custom loop that forgets zero_grad()."""
import pytest
import torch
from torch import nn

from megalite.distributed import mesh as mesh_module
from megalite.data_parallel import DataParallel
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.optim import DistributedOptimizer
from megalite.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megalite.testing import run_distributed


def _second_mesh_and_embedding():
    """On each of 2 ranks: (the refusal of a second layout, the replaced mesh's tp, the refusal of an
    id past the vocabulary at tp 2, the embedding of valid ids equals nn.Embedding's)."""
    init_mesh(tp=2)
    try:
        init_mesh(tp=1)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    torch.manual_seed(0)
    embedding = VocabParallelEmbedding(10, 4)  # padded to 10 rows, 5 per rank
    torch.manual_seed(0)
    reference = nn.Embedding(10, 4)
    same = torch.equal(embedding(torch.tensor([[0, 9, 5]])), reference(torch.tensor([[0, 9, 5]])))
    try:
        embedding(torch.tensor([[3, 10]]))  # nn.Embedding raises; at tp 2 this returned a zero row
        past_vocabulary = None
    except RuntimeError as exc:
        past_vocabulary = str(exc)
    replaced = init_mesh(tp=1, replace=True).tp_size
    return refused, replaced, past_vocabulary, same


def test_a_second_layout_needs_replace_and_ids_past_the_vocabulary_fail():
    for refused, replaced, past_vocabulary, same in run_distributed(_second_mesh_and_embedding, 2, timeout_s=60):
        assert refused == ("init_mesh(tp=1, dp=2) while the mesh of tp=2, dp=1 is live: call destroy_mesh() first "
                           "(layers built on the first mesh keep its groups), or pass replace=True")
        assert replaced == 1 and same
        assert "an input id is outside the vocabulary [0, 10)" in past_vocabulary


def test_tensor_parallel_layers_before_init_mesh_under_a_launch_refuse(monkeypatch):
    monkeypatch.setattr(mesh_module, "_CURRENT_MESH", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"built before init_mesh\(\) under a multi-rank launch .* would run at tp 1"):
        ColumnParallelLinear(8, 8)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ColumnParallelLinear(8, 8).weight.shape == (8, 8)  # one process: no parallelism, as before


def test_an_id_in_the_padding_rows_fails_at_tp_1_too():
    embedding = VocabParallelEmbedding(10, 4, padded_num_embeddings=16)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        embedding(torch.tensor([12]))  # a padding row: zeros, silently


def test_distributed_optimizer_names_the_wrapper_it_needs():
    with pytest.raises(TypeError, match=r"takes the DataParallel wrapper, not a bare Linear: model = DataParallel"):
        DistributedOptimizer(nn.Linear(4, 4))


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_loop_without_zero_grad_is_refused_at_every_zero_stage(zero):
    torch.manual_seed(0)
    model = DataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), single_process_mesh("cpu"), zero_stage=zero)
    optimizer = DistributedOptimizer(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    optimizer.step(lr=1e-2)
    with pytest.raises(RuntimeError, match=r"without zero_grad\(\): call optimizer.zero_grad\(\)"):
        model(x).sum().backward()  # the reduced gradient of step 1 would be counted again
    optimizer.zero_grad()
    model(x).sum().backward()  # with zero_grad: fine
    optimizer.step(lr=1e-2)


def _moe_at_etp1_on(tokens):
    from megalite.distributed.mesh import destroy_mesh
    from megalite.training.step import build_model_chunks

    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "moe"))
    from moe_helpers import cfg_for

    cfg = cfg_for(tp=2, num_layers=1, seq_length=32)
    mesh = init_mesh(layout=cfg.layout())
    try:
        model = build_model_chunks(cfg.gpt_config(), cfg, mesh)[0]
        ids = torch.randint(0, 257, (1, tokens))
        try:
            return tuple(model(ids).shape)
        except ValueError as exc:
            return str(exc)
    finally:
        destroy_mesh()


def test_moe_at_etp_1_takes_a_token_count_tp_does_not_divide():
    # was refused in one line ("... 21 tokens do not split evenly"): the tp ranks now route 11 and 10 rows
    # (tests/moe/test_moe_uneven.py proves the model equal to the single process's)
    assert run_distributed(_moe_at_etp1_on, 2, 21, timeout_s=60) == [(1, 21, 256)] * 2  # [b, s, V_pad / tp]
