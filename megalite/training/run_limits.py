"""Where a run may write and when it stops early, decided the same way on every rank.

    refuse_foreign_checkpoints(cfg, plan)        # before any process group: --save holds another run's steps
    reason = exit_reason(cfg, step, started, mesh)  # after a step: --exit-interval, --exit-duration-in-mins
"""
from __future__ import annotations

import time

import torch

from megalite.distributed import comm
from megalite.checkpoint.elastic import ResumePlan, find_checkpoint
from megalite.checkpoint.lock import foreign_checkpoints_problem
from megalite.config import RunConfig
from megalite.errors import UsageError
from megalite.distributed.mesh import Mesh


def refuse_foreign_checkpoints(cfg: RunConfig, plan: ResumePlan | None) -> None:
    """A UsageError when --save holds checkpoints this run would write over without having loaded them."""
    ck = cfg.checkpoint
    if not ck.save:
        return
    resumed = plan.step if plan is not None else None
    if resumed is None and plan is None and ck.load and not ck.no_load_optim:  # train(cfg) called without a plan
        found = find_checkpoint(ck.load, ck.load_step)
        resumed = found[0] if found else None
    problem = foreign_checkpoints_problem(ck.save, load_dir=None if ck.no_load_optim else ck.load,
                                          resumed_step=resumed, overwrite=ck.overwrite_checkpoints)
    if problem:
        raise UsageError(problem)


def exit_reason(cfg: RunConfig, step: int, started: float, mesh: Mesh) -> str | None:
    """--exit-interval / --exit-duration-in-mins: why the run stops after `step`, or None. The duration is
    agreed (the longest of every rank's, one 1-element all-reduce) so every rank stops after the same step."""
    t = cfg.training
    if t.exit_interval and step % t.exit_interval == 0 and step < t.train_iters:
        return f"--exit-interval {t.exit_interval}"
    if t.exit_duration_in_mins is None or step >= t.train_iters:
        return None
    minutes = torch.tensor([(time.monotonic() - started) / 60.0], dtype=torch.float64, device=mesh.device)
    comm.all_reduce(minutes, comm.world_group(), op="max")
    if minutes.item() < t.exit_duration_in_mins:
        return None
    return f"--exit-duration-in-mins {t.exit_duration_in_mins:g} ({minutes.item():.1f} minutes of training)"
