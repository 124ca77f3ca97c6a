"""Layout-free checkpoints: save at one (tp, pp, dp, zero, virtual stages), load at any other.

- `Checkpointer` (save.py): sync or background saves, atomic publish, retention; a save that
  cannot be written raises `CheckpointWriteError` on every rank (write_failure.py).
- `load_checkpoint` (load.py): newest intact checkpoint, verified, with fallback.
- `PreemptionHandler` (preemption.py): SIGTERM/SIGUSR1 -> save at the next step boundary.
- `read_full_state` / `write_full_state` (full_state.py): whole tensors, for conversion tools.

Format and protocol: storage.py (files), boxes.py (what a stored slice is), snapshot.py
(what each rank writes).
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.checkpoint.full_state": ["read_full_state", "write_full_state"],
    "megalite.checkpoint.load": ["LoadedCheckpoint", "load_checkpoint"],
    "megalite.checkpoint.lock": ["CheckpointLock"],
    "megalite.checkpoint.preemption": ["PreemptionHandler", "SetupInterrupted", "interrupt_during_setup",
                                       "maybe_inject_fault"],
    "megalite.checkpoint.save": ["Checkpointer"],
    "megalite.checkpoint.storage": ["CheckpointCorruptError", "CheckpointMismatchError", "CheckpointNotFoundError"],
    "megalite.checkpoint.write_failure": ["CheckpointWriteError"],
})
