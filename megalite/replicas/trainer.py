"""Recovery without a restart in the training program: this job is one replica group of --ft-replica-groups.

Each replica group is its own job and world (a torchrun job, or one process): its tp, pp and dp ranks,
its ZeRO shards, the loop's collectives (the token count, the loss, the guards, the goodput ledger)
stay inside it. Nothing static spans the groups: they meet in the run's store (--ft-store, the quorum
of quorum.py) and on one replica link per rank position s (rank s of every group, replica_link.py),
rebuilt per quorum. The loop calls, per step (megalite/training/loop.py, step.py):

    start()              once, before the steps: the first quorum; a restarted group asks to join and
                         is healed from a live one (masters, Adam moments, step count and the sampler's
                         position, rank s from rank s): the step it continues at, no checkpoint read
    begin_step(k)        the quorum of step k (the group's rank 0 agrees, its ranks receive the decision
                         in one collective inside the group); the heal when restarted groups join
    totals = (L, T)      train_step: the group's loss sum and target tokens of step k
    reduce(grad_shard)   GradBuffers.finish_reduction, in place of the across-replicas all-reduce: one
                         float64 all-reduce over the link of [gradient * T, L, T] (the group's gradient is
                         its own mean, scaled by 1 / T in the backward); the outcome; a retry without a
                         group that died; then the gradient / the surviving tokens (the mean over the
                         samples that survived) and the surviving loss for the step's record

The data: each group reads its own share of a batch of --ft-replica-groups x --global-batch-size
(dp rank g * dp + r of a data-parallel world of groups x dp; `sampler_place`), so a dead group's samples
of a step are dropped, never read by another group, and the position is the step's alone.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import uuid

import torch
import torch.distributed as dist

from megalite.distributed import comm
from megalite.errors import UsageError
from megalite.replicas.membership import GroupBroken, Heartbeat, decided_in_group, within_group
from megalite.replicas.quorum import PREFIX, Decision, Excluded, Quorum, QuorumLost, RunFinished, beat_key
from megalite.replicas.replica_link import ReplicaLink, heal

REPLICA_ENDS = (QuorumLost, GroupBroken, RunFinished)  # the one-line ends of a replica group (end_in_one_line)


def store_address(text: str | None) -> tuple[str, int]:
    """HOST:PORT of --ft-store (UsageError for anything else)."""
    host, _, port = (text or "").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ft-store {text!r} is not HOST:PORT; give the address of the run's store, e.g. "
                         f"--ft-store 10.0.0.1:29600")
    return host, int(port)


def sampler_place(cfg, mesh) -> tuple[int, int, int, int]:
    """(global batch, micro batch, dp rank, dp size) of this rank's data sampler: the mesh's, or under
    --ft-replica-groups its share of the whole run's batch (each group's --global-batch-size, group g's
    dp ranks after those of groups 0..g-1)."""
    ft, batch, micro = cfg.fault_tolerance, cfg.global_batch_size, cfg.training.micro_batch_size
    if not ft.ft_replica_groups:
        return batch, micro, mesh.dp_rank, mesh.dp_size
    groups = ft.ft_replica_groups
    return groups * batch, micro, ft.ft_group_id * mesh.dp_size + mesh.dp_rank, groups * mesh.dp_size


def end_in_one_line(exc: Exception, rank: int) -> int:
    """A replica group's end (REPLICA_ENDS) in one line: by its rank 0, or by every rank of a broken group;
    the exit code: 0 when the run finished without it, else 1 (torchrun restarts a broken group). A broken
    group's rank leaves at once: the job's clean end would meet the lost rank at a barrier."""
    if rank == 0 or isinstance(exc, GroupBroken):
        print(f"megalite: {exc}", file=sys.stderr, flush=True)
    if isinstance(exc, GroupBroken):
        sys.stdout.flush()
        os._exit(1)
    return 0 if isinstance(exc, RunFinished) else 1


class ReplicaTraining:
    """This rank's side of recovery without a restart in the training loop (module docstring)."""

    def __init__(self, cfg, *, model, optimizer, sampler, log=print):
        ft = cfg.fault_tolerance
        self.group, self.groups, self.log = ft.ft_group_id, ft.ft_replica_groups, log
        self.position, ranks = comm.global_rank(), comm.group_size(comm.world_group()) if comm.is_initialized() else 1
        self.ranks, self.join_timeout_s = ranks, ft.ft_join_timeout_s
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        host, port = store_address(ft.ft_store)
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=max(ft.ft_join_timeout_s, ft.ft_timeout_s)))
        incarnation = uuid.uuid4().hex
        if ranks > 1:  # the group's start is named once, by its rank 0
            incarnation = comm.all_gather_object(incarnation, comm.world_group())[0]
        self.heartbeat = Heartbeat(host, port, key=beat_key(self.group, incarnation, self.position),
                                   period_s=ft.ft_dead_after_s / 5, timeout_s=ft.ft_timeout_s)
        self.quorum = Quorum(store, group=self.group, num_groups=self.groups, min_groups=ft.ft_min_groups,
                             timeout_s=ft.ft_timeout_s, join_timeout_s=ft.ft_join_timeout_s,
                             dead_after_s=ft.ft_dead_after_s, positions=ranks, position=self.position,
                             incarnation=incarnation)
        self.link = ReplicaLink(store, group=self.group, timeout_s=ft.ft_timeout_s, position=self.position)
        self.decision: Decision | None = None
        self.totals: tuple[float, float] | None = None  # the group's (loss sum, target tokens) of the step
        self.surviving: tuple[float, float] | None = None  # the members' (loss sum, target tokens)
        self.healed, self.heal_s, self.retry_s, self.quorum_s = False, 0.0, 0.0, 0.0
        model.grads.replica_link = self  # the across-replicas reduction goes over the link

    @classmethod
    def of(cls, cfg, **parts) -> "ReplicaTraining | None":
        """The job's replica side under --ft-replica-groups, else None."""
        return cls(cfg, **parts) if cfg.fault_tolerance.ft_replica_groups else None

    # -- the quorum -------------------------------------------------------------------------------

    def _decided(self, agree) -> Decision:
        return decided_in_group(agree, ranks=self.ranks, group=self.group, position=self.position)

    def _inside(self, fn):
        return within_group(fn, group=self.group, position=self.position)

    def _admission(self, first_step: int) -> Decision:
        """Rank 0: the first quorum, or (the run has started: a restarted group) a request to join."""
        started = PREFIX + "started"
        if not self.quorum.store.check([started]):
            try:
                decision = self.quorum.agree(first_step, 0, range(self.groups), self.join_timeout_s)
                self.quorum.store.set(started, "1")
                return decision
            except Excluded:
                pass
        return self.quorum.join(self.join_timeout_s)

    def start(self, start_step: int) -> int:
        """The step the loop continues after: `start_step` (every group from the same start), or for a
        restarted group the live groups' step boundary it was admitted at, once healed."""
        self.decision = self._decided(lambda: self._admission(start_step + 1))
        while self.group in self.decision.joiners:
            if self._heal():
                self.log(f"replica group {self.group}: healed from replica group {self.decision.healer} at step "
                         f"{self.decision.step} (members {list(self.decision.members)}); no checkpoint read")
                break
            self.decision = self._decided(lambda: self.quorum.join(self.join_timeout_s))
        return self.decision.step - 1

    def begin_step(self, step: int) -> None:
        """The quorum of `step` (already decided for a restarted group's first), and its heal."""
        if self.decision.step != step:  # (a restarted group's first step: decided, and healed, in start)
            self.healed, self.heal_s, self.retry_s = False, 0.0, 0.0
            started = time.monotonic()
            self._agree(step, 0, self.decision.members)
            self.quorum_s = time.monotonic() - started  # waiting for the others: a dead group's silence too
        while self.decision.joiners and self.group not in self.decision.joiners:
            if self._heal():
                break
            self._retry()

    def finish(self) -> None:
        if self.position == 0:
            self.quorum.finish()

    def _retry(self) -> None:
        """The step's next round without the groups lost in this one (restarted ones wait for the next step)."""
        self._inside(lambda: comm.barrier(comm.world_group()) if self.ranks > 1 else None)  # this group whole?
        d = self.decision
        self._agree(d.step, d.round + 1, d.members, admit=False)

    def _agree(self, step: int, round: int, expected, admit: bool = True) -> None:
        try:
            self.decision = self._decided(lambda: self.quorum.agree(step, round, expected, admit=admit))
        except Excluded as late:  # dropped while alive (slower than --ft-timeout-s): leave, rejoin restarted
            raise GroupBroken(f"{late}; it ends and heals when restarted") from None

    # -- the link ---------------------------------------------------------------------------------

    def _heal(self) -> bool:
        """The decision's heal at this rank's position, then its outcome over every rank of every member; a
        joiner then publishes its parameters and takes the healer's data position."""
        started, ok, d = time.monotonic(), True, self.decision
        try:
            if self.link.needs_rebuild(d):
                self.link.rebuild(d)
            (consumed,) = heal(self.link, self.optimizer, d, lambda work: self._wait_or_give_up(work, "heal"),
                               extra=(self._position(),))
        except RuntimeError:
            self.link.close()
            ok = False
        ok = self.quorum.outcome(d, ok, phase="heal")
        if ok and self.group in d.joiners:
            self._inside(self.optimizer.publish_params)  # the parameters from the received masters
            self.sampler.consumed_samples = int(consumed)
            self.healed = True
        self.heal_s += time.monotonic() - started
        return ok

    def _position(self) -> float:
        """The sampler's position at the start of this step: the loop drew the step's batch before begin_step
        (a restarted group, healed before its first draw, only receives it)."""
        return float(self.sampler.consumed_samples - getattr(self.sampler, "last_batch_size", 0))

    def _wait_or_give_up(self, work, phase: str) -> None:
        """Wait for a link collective; give it up (RuntimeError) once another member settled the phase's
        outcome (only a failure settles it early): a ring member whose neighbour failed would wait out
        the link's timeout."""
        pause = 0.0005
        while not work.is_completed():
            if self.quorum.failed_already(self.decision, phase):
                raise RuntimeError(f"step {self.decision.step}: another member's {phase} failed")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        work.wait()

    def reduce(self, grad_shard: torch.Tensor) -> None:
        """The across-replicas reduction of the step (GradBuffers.finish_reduction), in place: `grad_shard`
        [shard numel], this rank's shard of the group's mean gradient, becomes the members' mean over
        their surviving target tokens."""
        loss_sum, tokens = self.totals
        packed = torch.cat([grad_shard.double() * tokens, torch.tensor([loss_sum, tokens], dtype=torch.float64)])
        failed_at = None
        while True:
            attempt = time.monotonic()
            reduced = self._reduce_once(packed)
            if self.quorum.outcome(self.decision, reduced is not None):
                break
            failed_at = failed_at if failed_at is not None else attempt
            self._retry()
        self.retry_s = attempt - failed_at if failed_at is not None else 0.0
        grad_shard.copy_(reduced[:-2] / reduced[-1].clamp(min=1.0))  # float64, rounded once to fp32
        self.surviving = (float(reduced[-2]), float(reduced[-1]))

    def _reduce_once(self, packed: torch.Tensor) -> torch.Tensor | None:
        try:
            if self.link.needs_rebuild(self.decision):
                self.link.rebuild(self.decision)
            reduced = packed.clone()
            self._wait_or_give_up(self.link.all_reduce(reduced, async_op=True), "reduction")
            return reduced
        except RuntimeError:  # a member lost: gloo's closed connection or timeout, a store timeout
            self.link.close()
            return None

    def fields(self) -> dict:
        """The step's metrics record fields: its members, the groups whose samples it dropped, its rounds."""
        d = self.decision
        return {"ft_members": list(d.members), "ft_dropped": [g for g in range(self.groups) if g not in d.members],
                "ft_rounds": d.round + 1, "ft_healed": self.healed, "ft_heal_s": self.heal_s, "ft_retry_s": self.retry_s,
                "ft_quorum_s": self.quorum_s}
