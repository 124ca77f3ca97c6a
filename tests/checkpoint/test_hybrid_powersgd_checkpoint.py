"""PowerSGD's state under hybrid sharding in a checkpoint (megalite/checkpoint/compression_state.py):
every rank's residual share and every shard position's Q are stored, so a run saved mid-way resumes
exactly (losses bit for bit) at the same layout.
"""
import pytest

from megalite.distributed import mesh
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.testing import run_distributed

from ckpt_helpers import GLOBAL, build, model_config, train, train_config

SAVED, STEPS = 2, 4
QUIET = dict(log=lambda *_: None)
LOW = dict(grad_compression="powersgd", powersgd_rank=2, powersgd_min_compression=0.0)


def _world(tmp, dp, s, zero):
    m = mesh.init_mesh(dp=dp, dp_shard=s, replace=True)
    cfg = train_config(dp=dp, dp_shard=s, zero=zero, **LOW)
    chunks, optimizer = build(model_config(), cfg, m)
    reference = train(chunks, optimizer, m, cfg, range(1, STEPS + 1))
    chunks, optimizer = build(model_config(), cfg, m)
    first = train(chunks, optimizer, m, cfg, range(1, SAVED + 1))
    Checkpointer(tmp, m, **QUIET).save(SAVED, chunks, optimizer, consumed_samples=SAVED * GLOBAL,
                                       model_config=model_config(), train_config=cfg)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(tmp, chunks, optimizer, m, **QUIET).step == SAVED
    return reference, first + train(chunks, optimizer, m, cfg, range(SAVED + 1, STEPS + 1))


def _check(tmp_path, dp, s, zero):
    for reference, resumed in run_distributed(_world, dp, tmp_path, dp, s, zero, timeout_s=300):
        assert resumed == reference, (resumed, reference)


def test_hybrid_powersgd_resumes_exactly(tmp_path):
    _check(tmp_path, 2, 1, 1)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_hybrid_powersgd_resumes_exactly_at_2x2(tmp_path, zero):
    _check(tmp_path, 4, 2, zero)
