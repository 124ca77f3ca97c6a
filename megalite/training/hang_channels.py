"""Side channels for hang reports: how ranks exchange their state when collectives are hung.

`FileChannel`: files in a directory every rank of a node (or, on a shared file system, of the
job) can see. `StoreChannel`: a key-value store with torch.distributed's Store API (the job's
rendezvous TCPStore on a connection of its own, `megalite.distributed.comm.side_channel_store()`), which
reaches every node. Neither uses a collective. Each publishes one JSON state per rank, lets one
rank claim the summary, and tells the others when the summary exists.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # readers see the whole file or none


class FileChannel:
    """Side channel through a directory: one state file per rank, a lock file elects the summariser.

    Works while collectives do not; covers the ranks that see the directory (one node for a
    local temp dir, the whole job on a shared file system).
    """

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def reset(self, rank: int) -> None:
        """Forget what an earlier incarnation of `rank` left (rank 0 also clears the summary)."""
        os.makedirs(self.directory, exist_ok=True)
        for name in [f"hang_rank{rank}.json"] + (["hang_summary.txt", "hang_summary.lock"] if rank == 0 else []):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(name))

    def publish(self, rank: int, state: dict[str, Any]) -> None:
        os.makedirs(self.directory, exist_ok=True)
        write_atomic(self._path(f"hang_rank{rank}.json"), json.dumps(state))

    def states(self, world_size: int) -> dict[int, dict[str, Any]]:
        states = {}
        for rank in range(world_size):
            with contextlib.suppress(OSError, ValueError):
                with open(self._path(f"hang_rank{rank}.json")) as f:
                    states[rank] = json.load(f)
        return states

    def claim_summary(self) -> bool:
        """True for exactly one caller."""
        try:
            os.close(os.open(self._path("hang_summary.lock"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def post_summary(self, text: str) -> None:
        write_atomic(self._path("hang_summary.txt"), text)

    def has_summary(self) -> bool:
        return os.path.exists(self._path("hang_summary.txt"))


class StoreChannel:
    """Side channel through a key-value store with torch.distributed's Store API (set, get, check, add).

    Covers every node. Give it a client on its *own* connection (the job's TCPStore, reached
    anew): the process group's client may itself be blocked in a store wait, and a TCPStore
    client serialises its calls. Keys live under `prefix`; the store must be private to this
    start of the job so a restarted job does not read the last one's states, as
    `megalite.distributed.comm.side_channel_store()` is (a namespace agreed afresh by every attempt).
    """

    def __init__(self, store, prefix: str = "megalite/hang/"):
        self.store = store
        self.prefix = prefix

    def reset(self, rank: int) -> None:
        pass  # keys are per incarnation (prefix); nothing to clear

    def publish(self, rank: int, state: dict[str, Any]) -> None:
        self.store.set(f"{self.prefix}state/{rank}", json.dumps(state))

    def states(self, world_size: int) -> dict[int, dict[str, Any]]:
        states = {}
        for rank in range(world_size):
            key = f"{self.prefix}state/{rank}"
            if self.store.check([key]):  # get() would block until the key exists
                states[rank] = json.loads(self.store.get(key))
        return states

    def claim_summary(self) -> bool:
        return self.store.add(f"{self.prefix}summary_claims", 1) == 1

    def post_summary(self, text: str) -> None:
        self.store.set(f"{self.prefix}summary", text)

    def has_summary(self) -> bool:
        return self.store.check([f"{self.prefix}summary"])
