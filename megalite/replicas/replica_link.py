"""The communicator across the live replica groups of one quorum, and the heal that travels on it.

A gloo process group with a dead member hangs or fails every later collective, and torch cannot take
a member out of one. So the cross-group group is never the static one: each quorum whose members
differ from the last (or a retry of a step) builds a new ProcessGroupGloo over a fresh prefix of the
run's store (`<prefix>pg/<step>/<round>/<position>/`: one link per rank position s of the groups, over
rank s of every member), ranks numbered by the members' order, with a timeout, so
a peer that dies mid-collective costs the survivors an error (a closed connection: at once) or the
timeout, never a hang. Only the survivors take part in the rebuild; the dead group's addresses are
never read (they live under an older prefix).

The heal (a restarted group joining at a step boundary) is a broadcast from the decision's healer of
everything a group's state is made of at that boundary: the fp32 master chunks and Adam's moments of
this rank's shard (the same positions hold the same elements in every group), and the optimizer's
step count; the data position is the decision's step (the training program sends its sampler's). Bytes are copied exactly, so the healed group's
parameters equal the healer's bit for bit. Every member receives it (gloo's broadcast to the group:
the healthy ones receive what they hold); with a few groups that costs no more time than a
point-to-point send, since the links run in parallel.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megalite.distributed import comm
from megalite.replicas.quorum import PREFIX, Decision


class ReplicaLink:
    """This rank's end of the cross-group communicator of its shard position (module docstring)."""

    def __init__(self, store, *, group: int, timeout_s: float, position: int = 0):
        self.store, self.group, self.timeout_s, self.position = store, group, timeout_s, position
        self.process_group = None  # None: alone (or not built yet); comm treats it as a group of one
        self.retired: list = []  # groups of failed attempts (see close)
        self.members: tuple[int, ...] = ()
        self.built_for: str | None = None  # the key of the decision the group was built for

    def needs_rebuild(self, decision: Decision) -> bool:
        """A retry (round > 0) or other members need a new group, once per decision (the heal and the
        reduction of one attempt share it)."""
        return decision.key != self.built_for and (decision.round > 0 or decision.members != self.members)

    def rebuild(self, decision: Decision) -> None:
        """Rank `position` of every member of `decision` calls this; it returns once all of them have
        connected (or raises)."""
        self.close()
        if len(decision.members) > 1:
            store = dist.PrefixStore(f"{PREFIX}pg/{decision.key}/{self.position}/", self.store)
            self.process_group = dist.ProcessGroupGloo(store, decision.members.index(self.group),
                                                       len(decision.members),
                                                       datetime.timedelta(seconds=self.timeout_s))
        self.members, self.built_for = decision.members, decision.key

    def close(self) -> None:
        """Drop this member's end after a failed collective. The group is kept alive, not destroyed: a
        ProcessGroupGloo destroyed after a failed collective can abort the process (seen under the
        drills), so failed groups are retired and live until the process ends."""
        if self.process_group is not None:
            self.retired.append(self.process_group)
        self.process_group, self.members, self.built_for = None, (), None

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum `tensor` in place over the members (raises RuntimeError when one is lost); with async_op
        a handle to wait on (its wait raises)."""
        work = comm.all_reduce(tensor, self.process_group, async_op=async_op)
        return work if async_op else tensor

    def broadcast_from(self, tensor: torch.Tensor, source_group: int):
        """Start broadcasting `tensor` from member `source_group`; a handle to wait on (its wait raises)."""
        return comm.broadcast_from_member(tensor, self.members.index(source_group), self.process_group,
                                          async_op=True)


def heal_tensors(optimizer) -> list[torch.Tensor]:
    """The state a replica group hands a restarted one, in place: per bucket the fp32 master chunk, then
    Adam's moments of this rank's shard, then the step count (a one-element tensor)."""
    if optimizer.muon is not None or optimizer.loss_scaler is not None or not isinstance(optimizer.exp_avg_sq,
                                                                                          torch.Tensor):
        raise ValueError("in-place recovery covers AdamW without a loss scaler (fp32 or bf16 training)")
    return [*optimizer.master_chunks(), optimizer.exp_avg, optimizer.exp_avg_sq]


def heal(link: ReplicaLink, optimizer, decision: Decision, wait, extra: tuple[float, ...] = ()) -> tuple[float, ...]:
    """Run the decision's heal on this rank (of the healer, a joiner or a bystander) at its position: its
    shard maps one to one onto the healer's rank of the same position. One float64 broadcast of everything
    (fp32 values survive the round trip exactly) and of `extra` (the training program's data position):
    one collective, so a member lost in it fails every member's heal alike. `wait(handle)` waits for it,
    giving up (RuntimeError) once another member settled the heal's outcome. The state is written only
    after the broadcast completed; the caller publishes the parameters once every rank of every member
    healed (its outcome). Returns the healer's `extra`."""
    tensors = heal_tensors(optimizer)
    flat = torch.cat([t.reshape(-1).double() for t in tensors] +
                     [torch.tensor([float(optimizer.step_count), *extra], dtype=torch.float64)])
    wait(link.broadcast_from(flat, decision.healer))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    optimizer.step_count = int(flat[offset].item())
    return tuple(flat[offset + 1:].tolist())
