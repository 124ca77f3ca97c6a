"""--check-replicas-interval at ZeRO-3 under hybrid sharding compares the replica groups' shards
(megalite/training/guards.py `check_replicas(..., replica_pieces=...)`): at ZeRO-3 no rank holds whole
parameters, so without it only the tp ranks were compared and a drifted replica group went unseen.
"""
import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.testing import run_distributed
from megalite.training.guards import ReplicaMismatchError, check_replicas
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

from test_hybrid_shard import _batches, _cfg, _model


def _world():
    m = mesh_lib.init_mesh(dp=2, dp_shard=1)
    cfg = _cfg(dp=2, dp_shard=1, zero=3)
    chunks = build_model_chunks(_model(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    model = optimizer.model
    train_step(model, optimizer, _batches(chunks[0].config.vocab_size, 2, m.dp_rank)[0], m, cfg, lr=1e-3)
    check_replicas(model.tp_replicated_pieces(), m, 1, shards=True, replica_pieces=model.shard_pieces())
    name, piece = model.shard_pieces()[-1]
    if m.rank == 1:
        with torch.no_grad():
            piece.view(-1)[0] += 1e-3  # replica group 1 drifts
    with pytest.raises(ReplicaMismatchError) as caught:
        check_replicas(model.tp_replicated_pieces(), m, 2, shards=True, replica_pieces=model.shard_pieces())
    return name, str(caught.value)


def test_zero3_replica_check_compares_the_replica_groups():
    for name, message in run_distributed(_world, 2):
        assert "replica groups of --dp-shard" in message and repr(name) in message, message
