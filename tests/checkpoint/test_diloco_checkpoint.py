"""DiLoCo checkpoints carry the outer state and every replica group's own inner state
(megalite/checkpoint/diloco_state.py): a run saved between outer steps resumes exactly.

2 ranks as 2 replica groups of S = 1, H = 2, outer lr 0.7 with Nesterov momentum 0.9 (so θ_outer and the
momentum both matter): 5 steps uninterrupted (outer steps after 2 and 4) against 3 steps, a save (one inner
step past an outer step: the groups' parameters and AdamW moments differ), a fresh build, a load and steps 4
and 5. The losses (over both groups' tokens) and every parameter of each group equal the uninterrupted run's
bit for bit. A load that gave group 1 group 0's inner state, or restarted θ_outer from the loaded masters,
changes step 4's loss.

Streaming (--diloco-fragments 2), saved after step 3, between fragment 0's sync and fragment 1's: at H = 2
(fragment 0 after odd steps, fragment 1 after even ones; quick) steps 4 and 5, and at H = 4 (fragment 0 after
steps 2 and 6, fragment 1 after 4; slow) steps 4-6, which run both fragments' outer steps from their own stored
θ_outer and momentum, equal the uninterrupted run's bit for bit.
"""
import contextlib
import io
import re

import pytest
import torch

from megalite.distributed import mesh
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import run_distributed
from megalite.training.loop import main

from ckpt_helpers import GLOBAL, build, model_config, train, train_config

SAVED, STEPS = 3, 5
QUIET = dict(log=lambda *_: None)
OUTER = dict(diloco_inner_steps=2, diloco_outer_lr=0.7, diloco_outer_momentum=0.9)
STREAMING = dict(OUTER, diloco_inner_steps=4, diloco_fragments=2)
STREAMING_EVERY_STEP = dict(OUTER, diloco_inner_steps=2, diloco_fragments=2)  # fragment 0 after odd steps, 1 after even


def _params(chunks, optimizer):
    with optimizer.model.gathered():
        return {n: p.detach().clone() for c in chunks for n, p in c.logical_parameters()}


def _world(tmp, zero, outer=OUTER, steps=STEPS):
    m = mesh.init_mesh(dp=2, dp_shard=1, replace=True)
    cfg = train_config(dp=2, dp_shard=1, zero=zero, **outer)
    chunks, optimizer = build(model_config(), cfg, m)
    reference = train(chunks, optimizer, m, cfg, range(1, steps + 1))
    reference_params = _params(chunks, optimizer)
    chunks, optimizer = build(model_config(), cfg, m)
    first = train(chunks, optimizer, m, cfg, range(1, SAVED + 1))
    Checkpointer(tmp, m, **QUIET).save(SAVED, chunks, optimizer, consumed_samples=SAVED * GLOBAL,
                                       model_config=model_config(), train_config=cfg)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(tmp, chunks, optimizer, m, **QUIET).step == SAVED
    resumed = first + train(chunks, optimizer, m, cfg, range(SAVED + 1, steps + 1))
    return reference, resumed, reference_params, _params(chunks, optimizer)


def _check(tmp_path, zero, outer=OUTER, steps=STEPS):
    for reference, resumed, reference_params, params in run_distributed(_world, 2, tmp_path, zero, outer, steps,
                                                                        timeout_s=240):
        assert resumed == reference, (resumed, reference)
        for name, value in reference_params.items():
            assert torch.equal(params[name], value), name


def test_diloco_resumes_exactly_between_outer_steps(tmp_path):
    _check(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_diloco_resumes_exactly_at_every_zero_stage(tmp_path, zero):
    _check(tmp_path, zero)


def test_streaming_diloco_resumes_exactly_between_two_fragments_syncs(tmp_path):
    _check(tmp_path, 1, STREAMING_EVERY_STEP)  # saved after fragment 0's sync, fragment 1's due next


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_streaming_diloco_resumes_exactly_two_steps_from_either_sync(tmp_path, zero):
    _check(tmp_path, zero, STREAMING, 6)


def _program(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, dict(re.findall(r"step (\d+)/\d+ \| loss (\S+)", out.getvalue()))


@pytest.mark.slow
def test_the_training_program_resumes_diloco(tmp_path):
    """--save and --load with --diloco-inner-steps through megalite's loop: steps 4 and 5 after a resume
    from step 3 log the uninterrupted run's losses."""
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0", "--log-interval", "1",
            "--zero", "1", "--dp-shard", "1", "--diloco-inner-steps", "2", "--diloco-outer-lr", "0.7",
            "--diloco-outer-momentum", "0.9", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--lr", "1e-3"]
    plain = run_distributed(_program, 2, argv + ["--train-iters", "5"], timeout_s=200)
    saved = run_distributed(_program, 2, argv + ["--train-iters", "3", "--save", str(tmp_path)], timeout_s=200)
    resumed = run_distributed(_program, 2, argv + ["--train-iters", "5", "--load", str(tmp_path),
                                                   "--override-opt-param-scheduler"], timeout_s=200)
    assert [code for code, _ in plain + saved + resumed] == [0] * 6
    uninterrupted, after = plain[0][1], resumed[0][1]  # rank 0 logs
    assert sorted(after) == ["4", "5"] and all(after[s] == uninterrupted[s] for s in after), (after, uninterrupted)


def _save_two_groups(tmp):
    m = mesh.init_mesh(dp=2, dp_shard=1, replace=True)
    cfg = train_config(dp=2, dp_shard=1, zero=1, **OUTER)
    chunks, optimizer = build(model_config(), cfg, m)
    train(chunks, optimizer, m, cfg, range(1, SAVED + 1))
    Checkpointer(tmp, m, **QUIET).save(SAVED, chunks, optimizer, consumed_samples=SAVED * GLOBAL,
                                       model_config=model_config(), train_config=cfg)
    return _params(chunks, optimizer)


@pytest.mark.slow
def test_a_run_without_diloco_loads_replica_group_0(tmp_path):
    """The layout-free reading of a DiLoCo checkpoint: a one-process run without DiLoCo reads replica group 0's
    inner state (the plain names) and ignores group 1's and the outer state."""
    group0, group1 = run_distributed(_save_two_groups, 2, tmp_path, timeout_s=200)
    assert any(not torch.equal(group0[n], group1[n]) for n in group0)  # saved between outer steps: they differ
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model_config(), cfg, m)
    load_checkpoint(tmp_path, chunks, optimizer, m, **QUIET)
    master = {name: entry["master"] for name, entry in optimizer.optimizer_state()["params"].items()}
    for name, value in group0.items():
        assert torch.equal(master[name].view(value.shape), value), name
