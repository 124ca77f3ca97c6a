"""DiLoCo across replica groups (megalite/data_parallel/diloco.py), against references built from plain runs.

- One replica group (dp 2 as S = 2), outer lr 1, no momentum: exactly plain training (losses and every
  parameter bit for bit).
- Two replica groups (dp 2 as 2 x S = 1), outer lr 1, no momentum: after H inner steps the parameters
  are the mean of the two groups' own runs (each a one-process run on its rank's half of every batch),
  to 1e-5 relative; and the replica group carries one fp32 shard per H steps.
"""
import pytest
import torch

from megalite.distributed import comm, mesh as mesh_lib
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

H, GLOBAL, SEQ = 2, 8, 16


def _model():
    return preset("tiny", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ)


def _cfg(dp=1, global_batch=GLOBAL, **kw):
    return RunConfig.build(dp=dp, micro_batch_size=2, global_batch_size=global_batch, lr=1e-3, weight_decay=0.1,
                           clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _batches(part, parts):
    """Step by step, the microbatches of `part` of `parts` equal slices of each global batch."""
    out = []
    for step in range(H):
        ids = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, :3 + step] = -100
        mine = slice(part * GLOBAL // parts, (part + 1) * GLOBAL // parts)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(2), labels[mine].split(2))])
    return out


def _train(m, cfg, part, parts):
    chunks = build_model_chunks(_model(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    comm.ledger.reset()
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss for mbs in _batches(part, parts)]
    replicate = comm.ledger.bytes.get(("dp_replicate", "all_reduce"), 0)
    with optimizer.model.gathered():
        params = {n: p.detach().clone() for c in chunks for n, p in c.logical_parameters()}
    return losses, params, replicate, optimizer.model.layout.shard_numel


def _world():
    outer = dict(diloco_inner_steps=H, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
    m = mesh_lib.init_mesh(dp_shard=2)
    one_group = {zero: (_train(m, _cfg(dp=2, dp_shard=2, zero=zero), 0, 1)[:2],
                        _train(m, _cfg(dp=2, dp_shard=2, zero=zero, **outer), 0, 1)[:2]) for zero in (1, 3)}
    m = mesh_lib.init_mesh(dp_shard=1, replace=True)
    two_groups = {zero: _train(m, _cfg(dp=2, dp_shard=1, zero=zero, **outer), m.dp_rank, 2) for zero in (1, 3)}
    plain = _train(m, _cfg(dp=2, dp_shard=1, zero=1), m.dp_rank, 2)[2]  # hybrid without DiLoCo: every step
    damped = _train(m, _cfg(dp=2, dp_shard=1, zero=1, diloco_inner_steps=1, diloco_outer_lr=0.5), m.dp_rank, 2)
    assert damped[0][0] == two_groups[1][0][0] and damped[0][1] != two_groups[1][0][1]  # lr 0.5, μ 0.9 moves it
    return one_group, two_groups, plain


def test_one_process_with_an_outer_step_of_lr_1_is_plain_training():
    """The outer step's arithmetic alone (one group, no communication): avg + 0*Δ - 0*m is avg, bit for bit."""
    m = single_process_mesh("cpu")
    plain = _train(m, _cfg(), 0, 1)
    outer = _train(m, _cfg(diloco_inner_steps=1, diloco_outer_lr=1.0, diloco_outer_momentum=0.0), 0, 1)
    assert outer[0] == plain[0] and all(torch.equal(outer[1][n], plain[1][n]) for n in plain[1])


@pytest.mark.parametrize("kw, needle", [
    (dict(dp=2, dp_shard=1, diloco_inner_steps=4, pp=2, global_batch=16), "drop --grad-compression, experts, --pp"),
    (dict(dp=2, dp_shard=1, diloco_inner_steps=4, check_replicas_interval=10), "lets differ between outer steps"),
])
def test_what_diloco_does_not_cover_yet_is_one_line(kw, needle):
    problems = _cfg(**kw).validate()
    assert len(problems) == 1 and needle in problems[0], problems


def test_diloco_saves_and_loads():  # its checkpoints carry the outer state (tests/checkpoint/test_diloco_checkpoint.py)
    assert _cfg(dp=2, dp_shard=1, diloco_inner_steps=4, save="/tmp/x", load="/tmp/x").validate() == []


@pytest.mark.slow
def test_diloco_is_plain_training_with_one_group_and_the_mean_of_the_groups_with_two():
    own = [_train(single_process_mesh("cpu"), _cfg(global_batch=GLOBAL // 2), part, 2)[1] for part in (0, 1)]
    mean = {name: (own[0][name] + own[1][name]) / 2 for name in own[0]}
    for one_group, two_groups, plain in run_distributed(_world, 2, timeout_s=180):
        for zero, ((plain_losses, plain_params), (losses, params)) in one_group.items():
            assert losses == plain_losses, zero
            assert all(torch.equal(params[n], plain_params[n]) for n in params), zero
        for zero, (_, params, replicate, shard) in two_groups.items():
            for name, value in params.items():
                assert_tensor_close(value, mean[name], rtol=1e-5, what=f"zero {zero} {name}")
            assert replicate == 4 * shard + 8 * H  # one fp32 shard in H steps (+ the steps' token counts)
        assert plain == H * 4 * two_groups[1][3]  # hybrid sharding without DiLoCo: the shard every step
