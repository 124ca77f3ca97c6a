"""A checkpoint that could not be written: the error every rank raises, and what it says.

A save fails for reasons the person running the job must fix: the file system is full
(ENOSPC, or a quota: EDQUOT), or the directory is not writable (EACCES, EPERM, EROFS). Each
rank reports how its part went (`write_status`); the ranks agree (all_gather_object) and,
if any failed, every rank raises the same `CheckpointWriteError`: one line naming the rank,
the directory, the reason, the bytes the checkpoint needs and the bytes that were free when
the save began, the fix, and which checkpoint remains the last good one.
"""
from __future__ import annotations

import errno
from pathlib import Path

from megalite.errors import UsageError

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointWriteError(UsageError, RuntimeError):
    """A checkpoint could not be written (full disk, unwritable directory); the last good one is kept."""


def human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def write_status(error: BaseException | None, free_bytes: int) -> dict:
    """This rank's part of a save, as exchanged between ranks (picklable, small)."""
    if error is None:
        return {"error": None, "errno": None, "free": free_bytes}
    code = getattr(error, "errno", None)
    reason = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
    return {"error": reason, "errno": code, "free": free_bytes}


def _fix(code: int | None) -> str:
    if code in _NO_SPACE:
        return "free space there or choose another --save directory"
    if code in _NOT_WRITABLE:
        return "make it writable by every rank or choose another --save directory"
    return "check that file system, or choose another --save directory"


def failure_error(step: int, root: Path, failures: list[tuple[int, dict]], needed_bytes: int,
                  latest_step: int | None) -> CheckpointWriteError:
    """The error for a save of `step` into `root` that failed on `failures` ([(rank, status)])."""
    rank, status = failures[0]
    others = f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
    kept = (f"the last good checkpoint, step {latest_step}, is kept" if latest_step is not None
            else "there is no earlier checkpoint")
    return CheckpointWriteError(
        f"checkpoint of step {step} not saved: rank {rank}{others} could not write to {root} ({status['error']}); "
        f"it needs {human_bytes(needed_bytes)} and {human_bytes(status['free'])} were free there when the save "
        f"began; {_fix(status['errno'])}; {kept} and the partial one was removed")
