"""Goodput so far: the share of the job's wall time that trained, and what the rest went to.

    goodput = productive step seconds / wall seconds, over every run of the job (restarts included)

Wall time counts from the first run's first step; each later run adds the gap since the previous
run was last seen (its processes dying, the new ones starting and building the job). Lost intervals
are named by cause:

    restart   from the previous run's last sign of life to this run's resume (detect, relaunch, build)
    reload    reading the checkpoint
    replay    the steps the previous run had done after that checkpoint, trained again (their seconds,
              at the previous run's mean step time, move from productive to lost)
    save      training blocked by checkpoint saves
    eval      validation passes
    heal      in-place recovery (megalite/fault_tolerance/): the survivors' step retried without a dead
              replica group and the live state sent to a restarted one (the chaos drills' ledgers,
              tools/fault_drill_chaos.py and tools/fault_drill_trainer.py; the training loop's own ledger
              does not name them yet: its records carry ft_heal_s and ft_retry_s)

What is left (wall - productive - lost) is "other": logging, guards, the first step's set-up. With
--save, rank 0 keeps the ledger in DIR/goodput.json (written atomically at every logged step), which
is how a restarted run knows the job's history. Host clock seconds (`time.time()`, which survives a
restart); no communication.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

CAUSES = ("restart", "reload", "replay", "save", "eval", "heal")
FILE = "goodput.json"


class GoodputLedger:
    """Productive and lost seconds of the job so far (see the module docstring)."""

    def __init__(self, save_dir: str | None, *, write: bool, clock: Callable[[], float] = time.time):
        self.path = Path(save_dir) / FILE if save_dir else None
        self.write_enabled, self.clock = write, clock
        self.started = clock()
        previous = self._read()
        self.base_wall = previous.get("wall_s", 0.0)  # earlier runs' wall seconds
        self.productive = previous.get("productive_s", 0.0)
        self.lost = {cause: previous.get("lost_s", {}).get(cause, 0.0) for cause in CAUSES}
        self.steps, self.last_step = previous.get("steps", 0), previous.get("last_step", 0)
        last_seen = previous.get("last_seen")
        if last_seen is not None:  # a restart: the gap since the previous run was last seen, up to now
            self.lost["restart"] += max(0.0, self.started - last_seen)
            self.base_wall += max(0.0, self.started - last_seen)

    def _read(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # a torn or foreign file: start the ledger afresh rather than fail the run

    def add_lost(self, cause: str, seconds: float) -> None:
        self.lost[cause] += seconds

    def resumed_at(self, step: int) -> None:
        """The checkpoint's step: the previous run's steps after it are trained again (replay)."""
        replayed = max(0, self.last_step - step)
        if replayed and self.steps:
            seconds = replayed * self.productive / self.steps
            self.productive -= seconds
            self.steps -= replayed
            self.lost["replay"] += seconds
        self.last_step = step

    def step_done(self, step: int, seconds: float) -> None:
        self.productive += seconds
        self.steps += 1
        self.last_step = step

    def wall(self) -> float:
        return self.base_wall + self.clock() - self.started

    def fields(self) -> dict[str, float]:
        """The metrics record's goodput fields: goodput, goodput_wall_s, and lost_<cause>_s where nonzero."""
        wall = self.wall()
        out = {"goodput": self.productive / wall if wall > 0 else 1.0, "goodput_wall_s": wall}
        out.update({f"lost_{cause}_s": s for cause, s in self.lost.items() if s > 0})
        return out

    def describe(self) -> str:
        """' | goodput 97.1% (lost: restart 40 s, reload 3 s, ...)' for the progress line."""
        lost = ", ".join(f"{cause} {s:.0f} s" for cause, s in self.lost.items() if s >= 0.5)
        return f" | goodput {100 * self.fields()['goodput']:.1f}%" + (f" (lost: {lost})" if lost else "")

    def persist(self) -> None:
        """Rank 0 with --save: the ledger as of now, written atomically (temp file + rename)."""
        if self.path is None or not self.write_enabled:
            return
        state = {"wall_s": self.wall(), "productive_s": self.productive, "lost_s": self.lost, "steps": self.steps,
                 "last_step": self.last_step, "last_seen": self.clock()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_suffix(".tmp")
        temp.write_text(json.dumps(state))
        os.replace(temp, self.path)
