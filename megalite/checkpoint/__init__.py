"""Layout-free checkpoints: save at one (tp, pp, dp, zero, virtual stages), load at any other.

- `Checkpointer` (save.py): sync or background saves, atomic publish, retention; a save that
  cannot be written raises `CheckpointWriteError` on every rank (write_failure.py).
- `load_checkpoint` (load.py): newest intact checkpoint, verified, with fallback.
- `PreemptionHandler` (preemption.py): SIGTERM/SIGUSR1 -> save at the next step boundary.
- `read_full_state` / `write_full_state` (full_state.py): whole tensors, for conversion tools.

Format and protocol: storage.py (files), boxes.py (what a stored slice is), snapshot.py
(what each rank writes).
"""
from megalite.checkpoint.full_state import read_full_state, write_full_state
from megalite.checkpoint.load import LoadedCheckpoint, load_checkpoint
from megalite.checkpoint.preemption import PreemptionHandler, maybe_inject_fault
from megalite.checkpoint.save import Checkpointer
from megalite.checkpoint.storage import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from megalite.checkpoint.write_failure import CheckpointWriteError

__all__ = ["Checkpointer", "CheckpointCorruptError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointWriteError", "LoadedCheckpoint", "PreemptionHandler", "load_checkpoint", "maybe_inject_fault",
           "read_full_state", "write_full_state"]
