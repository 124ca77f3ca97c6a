"""Checkpoints under hybrid sharding (--dp-shard S) are layout-free: S is part of the layout.

Only replica group 0 stores the ZeRO shards (each element once: the reader counts the stored
elements of a tensor against its size, so a second replica group's copies fail the load); a
checkpoint saved at dp 4 as 2 x 2 loads at flat dp 4 and at 4 replicas of S = 1, and one saved
flat loads at 2 x 2; each continues like the uninterrupted one-process run.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import run_distributed

from ckpt_helpers import GLOBAL, build, full_params, model_config, train, train_config

SAVED = 2
QUIET = dict(log=lambda *_: None)


def _save(chunks, optimizer, m, cfg, path):
    Checkpointer(path, m, **QUIET).save(SAVED, chunks, optimizer, consumed_samples=SAVED * GLOBAL,
                                         model_config=model_config(), train_config=cfg)


def _world(tmp, ref_losses):
    """Save at (S, zero) = (2, 3) and (4, 1); load each at the other S values and stages."""
    saves = {"s2 zero3": (2, 3), "flat zero1": (4, 1)}
    for name, (s, zero) in saves.items():
        m = mesh.init_mesh(dp=4, dp_shard=s, replace=True)
        cfg = train_config(dp=4, dp_shard=s, zero=zero)
        chunks, optimizer = build(model_config(), cfg, m)
        torch.testing.assert_close(train(chunks, optimizer, m, cfg, range(1, SAVED + 1)), ref_losses[:SAVED],
                                   rtol=1e-5, atol=0)
        _save(chunks, optimizer, m, cfg, tmp / name)
    loads = [("s2 zero3", 4, 1), ("s2 zero3", 1, 2), ("s2 zero3", 2, 3), ("flat zero1", 2, 1), ("flat zero1", 2, 3)]
    resumed = {}
    for name, s, zero in loads:
        m = mesh.init_mesh(dp=4, dp_shard=s, replace=True)
        cfg = train_config(dp=4, dp_shard=s, zero=zero)
        chunks, optimizer = build(model_config(), cfg, m)
        assert load_checkpoint(tmp / name, chunks, optimizer, m, **QUIET).step == SAVED
        resumed[f"{name} -> S={s} zero {zero}"] = train(chunks, optimizer, m, cfg, [3, 4])
    return resumed


@pytest.mark.slow
def test_hybrid_checkpoints_resume_across_dp_shard(tmp_path):
    m, cfg = single_process_mesh("cpu"), train_config()
    chunks, optimizer = build(model_config(), cfg, m)
    ref_losses = train(chunks, optimizer, m, cfg, range(1, SAVED + 1))
    ref_losses += train(chunks, optimizer, m, cfg, [3, 4])
    for resumed in run_distributed(_world, 4, tmp_path, ref_losses, timeout_s=300):
        for what, losses in resumed.items():
            torch.testing.assert_close(losses, ref_losses[SAVED:], rtol=1e-5, atol=0, msg=lambda s: f"{what}: {s}")
