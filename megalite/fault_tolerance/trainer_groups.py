"""The training program (examples/pretrain_gpt.py's main) as the replica groups of the launcher (tests and drills).

`Launcher(run, target=TrainerGroups(argv, metrics_dir))` starts each replica group's ranks as forked
processes running `megalite.training.loop.main` with `argv` plus the group's --ft-* settings (from `run`)
and a metrics file per group and start, `<metrics_dir>/group<g>.start<n>.jsonl`; a `TrainerFault` SIGKILLs a
rank of the group at the start of a step (MEGALITE_FAULT_AT_STEP: checkpoint/preemption.py); any other fault
object is installed in the forked rank (`fault.install(group)`: the chaos drill's seams, tools/fault_drill_trainer.py).
The launcher restarts a killed group, which asks to join and heals from a live group.

With `save_root`, group g saves to `<save_root>/group<g>` (--save): each group is its own job that saves the
same steps, so one shared directory would have two jobs write the same step_N.tmp/ and `latest` at once.
A restarted group never loads it (it heals from a live group) and saves its later steps there
(--overwrite-checkpoints: its dead incarnation's checkpoints are older, not a resume it skipped); the directory
is for a restart of the whole run.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.fault_tolerance.settings import FaultTolerantRun


@dataclass(frozen=True)
class TrainerFault:
    """SIGKILL rank `rank` of its group at the start of training step `step`."""

    step: int
    rank: int = 0


class TrainerGroups:
    """The launcher's target for the training program (module docstring)."""

    def __init__(self, argv: list[str], metrics_dir: str | Path, *, save_root: str | Path | None = None):
        self.argv, self.metrics_dir = list(argv), Path(metrics_dir)
        self.save_root = Path(save_root) if save_root is not None else None
        self.starts: dict[int, int] = {}

    def argv_of(self, run: FaultTolerantRun, group: int, start: int) -> list[str]:
        return [*self.argv, "--ft-replica-groups", str(run.groups), "--ft-group-id", str(group),
                "--ft-store", f"{run.store_host}:{run.store_port}", "--ft-min-groups", str(run.min_groups),
                "--ft-timeout-s", str(run.timeout_s), "--ft-dead-after-s", str(run.dead_after_s),
                "--ft-join-timeout-s", str(run.join_timeout_s),
                "--metrics-file", str(self.metrics_dir / f"group{group}.start{start}.jsonl"),
                *(["--save", str(self.save_root / f"group{group}"), "--overwrite-checkpoints"] if self.save_root is not None else [])]

    def __call__(self, run: FaultTolerantRun, group: int, position: int, joining: bool, fault, env: dict) -> None:
        from megalite.training import loop  # the forked rank's own import (the parent may not have it)
        os.environ.update(env)
        torch.set_num_threads(1)
        if fault is not None and not isinstance(fault, TrainerFault):
            fault.install(group)
        elif fault is not None:
            os.environ.update(MEGALITE_FAULT_AT_STEP=str(fault.step), MEGALITE_FAULT_RANK=str(fault.rank),
                              MEGALITE_FAULT_SIGNAL="SIGKILL")
        start = len(list(self.metrics_dir.glob(f"group{group}.start*.jsonl")))  # rank 0 writes the metrics
        sys.exit(loop.main(self.argv_of(run, group, start)))

    def records(self) -> list[dict]:
        """Every group's metrics records of training steps, each with its group ("ft_group")."""
        out = []
        for path in sorted(self.metrics_dir.glob("group*.start*.jsonl")):
            group = int(path.name[len("group"):].split(".")[0])
            for line in path.read_text().splitlines():
                record = json.loads(line) if line.strip() else {}
                if "ft_members" in record:
                    out.append({**record, "ft_group": group})
        return out
