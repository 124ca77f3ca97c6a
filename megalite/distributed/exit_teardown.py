"""The process group torn down at interpreter exit when the script never called `destroy_mesh()`.

Why: a gloo process group still alive when Python finalizes is destroyed during the
interpreter's teardown; its worker threads can still hold finished work objects whose
tensors drop Python references, which then needs the GIL of an interpreter that is going
away, and the process aborts ("terminate called without an active exception", SIGABRT),
so torchrun reports a finished job as failed. Destroying the group in an `atexit` handler
does the same work while the interpreter is still whole. `init_mesh` registers it once per
process, before the group exists, so it runs after any handler the user registers later (LIFO).
"""
from __future__ import annotations

import atexit
import sys
from typing import Callable

from megalite.distributed import comm

_STATE = {"registered": False, "crashed": False}


def register(destroy: Callable[[], None], backend: Callable[[], str | None]) -> None:
    """Run `destroy()` (the mesh's teardown) at exit; `backend()` names the live backend then."""
    if _STATE["registered"]:
        return
    _STATE["registered"] = True
    previous_hook = sys.excepthook

    def note_crash(kind, value, tb):  # an uncaught exception: the script exits 1 after atexit
        _STATE["crashed"] = True
        previous_hook(kind, value, tb)

    sys.excepthook = note_crash
    atexit.register(teardown_at_exit, destroy, backend)


def teardown_at_exit(destroy: Callable[[], None], backend: Callable[[], str | None]) -> None:
    """The atexit handler. A crash keeps its non-zero exit code (Python sets it, not this);
    after a crash under NCCL the teardown is skipped, since destroying NCCL communicators can
    wait for peers that will never come, while gloo's teardown is local."""
    if not comm.is_initialized():
        return
    if _STATE["crashed"] and backend() == "nccl":
        return
    try:
        destroy()
    except Exception as exc:  # noqa: BLE001 - never turn a clean exit into a traceback
        print(f"megalite: tearing down the process group at exit failed: {exc}", file=sys.stderr, flush=True)
