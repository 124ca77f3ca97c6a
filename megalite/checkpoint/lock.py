"""One run per checkpoint directory: a lock file in --save names the run that writes there.

    DIR/megalite.lock    {"host": "node7", "pid": 4242, "job": "slurm 81234", "since": 1730000000.0}

Two jobs with the same --save would overwrite each other's step directories and `latest`.
Global rank 0 creates the lock with O_EXCL before the first step and removes it when the run
ends; a daemon thread refreshes its modification time every REFRESH_S seconds. A lock found
there belongs to another run unless it is stale:
  - it names this host and a pid that no longer exists (a crashed or killed run), or
  - it names the same job (SLURM_JOB_ID, or torchrun's TORCHELASTIC_RUN_ID: a restart of this
    job after a failure), or
  - it names another host and was not refreshed for STALE_S seconds (that host is gone).
A stale lock is replaced (and said so); a live one is a UsageError naming its holder and the fix.

A run also refuses (`foreign_checkpoints_problem`, every rank, before any process group) to write
into a --save directory whose published checkpoints it did not load: a fresh run over an earlier
run's `step_N`, a run that loads elsewhere (or weights only), or one that resumes an older step
than the directory's newest. Its step directories would be replaced, `latest` moved and the
pruning would count them; the fix is --load DIR (resume them) or --overwrite-checkpoints.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from megalite.checkpoint import storage
from megalite.errors import UsageError

LOCK_NAME = "megalite.lock"
REFRESH_S, STALE_S = 30.0, 300.0


class CheckpointDirLocked(UsageError):
    """Another live run holds the lock of this --save directory."""


def job_id() -> str:
    """The scheduler's or torchrun's id of this job ('' when launched by hand)."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm {os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun {run_id}" if run_id and run_id != "none" else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def stale_reason(holder: dict, mtime: float, now: float | None = None) -> str | None:
    """Why the lock `holder` (last refreshed at `mtime`) no longer guards a live run, or None if it does."""
    now = time.time() if now is None else now
    if holder.get("job") and holder.get("job") == job_id():
        return f"it is this job's ({holder['job']}), from before a restart"
    if holder.get("host") == socket.gethostname():
        return None if _pid_alive(int(holder.get("pid", -1))) else f"process {holder.get('pid')} no longer exists"
    if now - mtime > STALE_S:
        return f"it was not refreshed for {now - mtime:.0f} s (host {holder.get('host')} is gone)"
    return None


class CheckpointLock:
    """The lock of `save_dir`, held from `acquire()` to `release()` (by global rank 0 only)."""

    def __init__(self, save_dir: str | Path, log=print):
        self.path = Path(save_dir) / LOCK_NAME
        self.log = log
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}

    def acquire(self) -> "CheckpointLock":
        """Take the lock, replacing a stale one; CheckpointDirLocked when a live run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._remove_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._mine(), f)
            self.held = True
            self._thread = threading.Thread(target=self._refresh, name="megalite-ckpt-lock", daemon=True)
            self._thread.start()
            return self
        raise CheckpointDirLocked(f"--save {self.path.parent}: another run took its lock ({self.path}) at the same "
                                  f"time; give each run its own --save directory")

    def _remove_if_stale(self) -> None:
        try:
            holder, mtime = json.loads(self.path.read_text() or "{}"), self.path.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            return
        except (OSError, ValueError):
            holder, mtime = {}, 0.0  # unreadable or half written: judged by its age alone
        reason = stale_reason(holder, mtime)
        if reason is None:
            who = f"host {holder.get('host')}, pid {holder.get('pid')}" + (f", job {holder['job']}" if holder.get("job")
                                                                            else "")
            raise CheckpointDirLocked(f"--save {self.path.parent} is in use by another run ({who}); give this run "
                                      f"another --save directory, or stop that run (if it is gone, delete {self.path})")
        self.log(f"checkpoint: replacing the stale lock {self.path}: {reason}")
        self.path.unlink(missing_ok=True)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
        self._stop.set()
        if self._thread is not None:  # it wakes at once; joined, so no lock thread outlives the run
            self._thread.join(timeout=5)
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _same_directory(load_dir: str | None, save_dir: str) -> bool:
    """Whether --load names --save itself (or one of its step directories)."""
    if not load_dir:
        return False
    load, save = Path(load_dir).resolve(), Path(save_dir).resolve()
    return load == save or (load.parent == save and storage.STEP_DIR.match(load.name) is not None)


def foreign_checkpoints_problem(save_dir: str, *, load_dir: str | None, resumed_step: int | None,
                                overwrite: bool) -> str | None:
    """The one line refusing a run that would write over checkpoints of `save_dir` it did not load,
    or None. `resumed_step`: the step this run resumes from `load_dir` (None: it starts at step 0).
    Only published checkpoints count (`latest` names them or a newer one): a step directory `latest`
    does not reach was never finished, and a resume writes over it as a crash left it."""
    root = Path(save_dir)
    latest = storage.latest_step(root)
    published = [s for s in storage.complete_steps(root) if latest is None or s <= latest]
    loaded_here = resumed_step is not None and _same_directory(load_dir, save_dir)
    foreign = [s for s in published if not loaded_here or s > resumed_step]
    if not foreign or overwrite:
        return None
    steps = ", ".join(str(s) for s in foreign[:4]) + (f" ... ({len(foreign)} in all)" if len(foreign) > 4 else "")
    what = (f"this run resumes step {resumed_step}, so it would write over the newer step {steps}" if loaded_here
            else f"this run {'loads ' + str(load_dir) if load_dir else 'starts fresh'} and would write over them")
    return (f"--save {save_dir} holds checkpoints this run did not load (step {steps}): {what}; resume them with "
            f"--load {save_dir}, give another --save directory, or pass --overwrite-checkpoints to replace them")
