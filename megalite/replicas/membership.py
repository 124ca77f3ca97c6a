"""What the ranks of one replica group live by: the group lives or dies whole (GroupBroken, within_group),
its rank 0's quorum decision handed to the others (decided_in_group), and each rank's heartbeat in the run's
store (Heartbeat), by which the quorum tells a dead group from a slow one."""
from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from megalite.distributed import comm
from megalite.replicas.quorum import Decision, Excluded, QuorumLost, RunFinished


class GroupBroken(Exception):
    """A collective inside this replica group failed: a rank of the group is gone, so the group is."""


def within_group(fn, *, group: int, position: int):
    """`fn()` (collectives inside this rank's replica group), a failure of it turned into GroupBroken."""
    try:
        return fn()
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0].split(". ")[0] if str(error).strip() else type(error).__name__
        raise GroupBroken(f"replica group {group} rank {position}: a collective inside the group failed "
                          f"({first[:160]}); a group lives or dies whole, so this rank exits and the group is "
                          f"restarted") from None


_RAISED = {"Excluded": Excluded, "QuorumLost": QuorumLost, "RunFinished": RunFinished}


def decided_in_group(agree, *, ranks: int, group: int, position: int) -> Decision:
    """`agree()` run by the group's rank 0; its decision (or its Excluded, QuorumLost, RunFinished)
    handed to every rank of the group in one collective inside it (GroupBroken if rank 0 is gone)."""
    if ranks == 1:
        return agree()
    verdict = None
    if position == 0:
        try:
            verdict = ("decision", agree().to_json())
        except (Excluded, QuorumLost, RunFinished) as raised:
            verdict = (type(raised).__name__, str(raised))
    gathered = within_group(lambda: comm.all_gather_object(verdict, comm.world_group()), group=group,
                            position=position)
    kind, payload = gathered[0]
    if kind != "decision":
        raise _RAISED[kind](payload)
    return Decision.from_json(payload)


class Heartbeat:
    """A daemon thread adding 1 to a rank's beat counter (`key`: quorum.beat_key) every `period_s`, on its
    own connection to the run's store: the quorum waits for a slow group whose ranks' counters all move,
    not for a dead one."""

    def __init__(self, host: str, port: int, *, key: str, period_s: float, timeout_s: float):
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self.key, self.period_s = key, period_s
        threading.Thread(target=self._beat, daemon=True, name=f"heartbeat {key}").start()

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except RuntimeError:
                return  # the run's store is gone: the run is over
            time.sleep(self.period_s)
