"""The deterministic reference of a fault-tolerant run of the training program: one process, the same samples
dropped.

The replica groups' metrics records (replicas/trainer.py's `fields`: each step's members) say which groups'
samples every step used. The reference trains the same model (the same flags, seed and schedule, one
process) through the loop's own `train_step`, at each step on exactly the microbatches those members read
(each group's share of the run's batch, `sampler_place`), so its loss is the mean over the samples that
survived. The run sums each group's gradient in float64 over the link while the reference accumulates
them in one buffer, so the two agree to rounding, not bit for bit (tests/fault_tolerance/test_trainer_recovery.py).
"""
from __future__ import annotations

import torch

from megalite.cli import parse_args
from megalite.data import GlobalBatchSampler, build_mock_datasets, load_microbatches
from megalite.distributed.mesh import single_process_mesh
from megalite.optim.lr_schedule import LRSchedule, ScheduledLR
from megalite.training.configure import configure
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step


def members_by_step(records: list[dict]) -> dict[int, tuple[int, ...]]:
    """{step: its members} from every group's records; AssertionError when two groups saw different members
    (a split quorum) or a step has no record (training stopped)."""
    members: dict[int, tuple[int, ...]] = {}
    for record in records:
        seen = members.setdefault(record["step"], tuple(record["ft_members"]))
        if seen != tuple(record["ft_members"]):
            raise AssertionError(f"step {record['step']}: groups disagree on the members ({seen} and "
                                 f"{tuple(record['ft_members'])})")
    missing = sorted(set(range(1, max(members, default=0) + 1)) - set(members))
    if missing:
        raise AssertionError(f"steps {missing} have no record: training stopped")
    return members


def reference_losses(argv: list[str], groups: int, members: dict[int, tuple[int, ...]]) -> dict[int, float]:
    """{step: loss} of one process running `argv` (--mock-data, dp 1 per group) on each step's members' samples."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the groups' processes run
    try:
        return _losses(argv, groups, members)
    finally:
        torch.set_num_threads(threads)


def _losses(argv: list[str], groups: int, members: dict[int, tuple[int, ...]]) -> dict[int, float]:
    cfg, _ = parse_args(argv)
    cfg = configure(cfg, 1, None)
    model_cfg, t, o = cfg.gpt_config(), cfg.training, cfg.optimizer
    mesh = single_process_mesh("cpu")
    torch.manual_seed(t.seed)
    model = build_data_parallel(build_model_chunks(model_cfg, cfg, mesh), cfg, mesh)
    optimizer = build_optimizer(model, cfg)
    scheduler = ScheduledLR(optimizer, LRSchedule(o.lr, o.min_lr, *cfg.lr_schedule_iters, o.lr_decay_style,
                                                  wsd_decay_iters=o.lr_wsd_decay_iters or 0,
                                                  wsd_style=o.lr_wsd_decay_style))
    train_set = build_mock_datasets(model_cfg.vocab_size, model_cfg.seq_length, t.seed, cfg.data.split)[0]
    samplers = [GlobalBatchSampler(len(train_set), groups * cfg.global_batch_size, t.micro_batch_size, g, groups,
                                   seed=t.seed) for g in range(groups)]  # group g's share (sampler_place, dp 1)
    losses = {}
    for step in sorted(members):
        consumed = (step - 1) * groups * cfg.global_batch_size
        indices = [mb for g in members[step] for mb in samplers[g].microbatches_at(consumed)]
        losses[step] = train_step(model, optimizer, load_microbatches(train_set, indices), mesh, cfg, None).loss
        scheduler.step()
    return losses
