"""One rank of one replica group of a fault-tolerant run: train, agree every step, survive the others'
deaths, heal.

Each replica group is its own world of W ranks (group_stack.py: megalite's model, DataParallel and
DistributedOptimizer, ZeRO over the W ranks; W = 1: one process). Nothing static spans the groups:
they meet only in the run's store (the quorum, quorum.py) and on the replica links, one per shard
position s (rank s of every member group), rebuilt per quorum (replica_link.py). One step:

    1. quorum (k, r)       the group's rank 0 agrees the members (the previous quorum's live groups +
                           restarted ones) in the store; its ranks receive the decision in one
                           collective inside the group (it fails at once when rank 0 is gone)
    2. rebuild, heal       a new link per position when the members changed; restarted groups receive
                           the live state position by position, then agree the heal's outcome
    3. local gradient      forward + backward of this rank's samples of step k, the losses summed, the
                           gradient reduce-scattered in the group: computed once, kept for a retry
    4. reduction           one float64 all-reduce over the position's link of [this rank's gradient
                           shard, the group's loss sum, target tokens]
    5. outcome (k, r)      ok when every rank of every member reported its reduction complete; else
                           round r + 1 from 1. with the survivors (a dead group's samples of k dropped)
    6. update              gradient / surviving tokens, clip, AdamW (the optimizer's own step)

So the step's gradient is the mean over the target tokens of the samples that survived, exactly what
a group on those samples alone computes (reference.py); every rank writes a record of each step
(members, dropped groups, heal, seconds, a fingerprint of its shard) to <log_dir>/group<g>.rank<s>.jsonl.
A collective inside the group that fails (a sibling was killed) ends the rank (GroupBroken): a group
lives or dies whole, and the launcher restarts it whole.
"""
from __future__ import annotations

import datetime
import json
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.distributed import comm
from megalite.fault_tolerance.group_stack import (StepRecord, build_stack, fingerprint, heartbeat_of, local_gradient,
                                                  update)
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.replicas.membership import GroupBroken, decided_in_group, within_group
from megalite.replicas.quorum import Decision, Excluded, Quorum
from megalite.replicas.replica_link import ReplicaLink, heal

__all__ = ["FAULT_MOMENTS", "GroupBroken", "ReplicaGroup", "StepRecord", "build_stack"]

FAULT_MOMENTS = ("forward", "reduction", "mid-reduction", "update")




class ReplicaGroup:
    """This rank of its replica group (module docstring); `run()` trains to the last step."""

    def __init__(self, run: FaultTolerantRun, group: int, *, joining: bool, fault=None, position: int = 0):
        """position: this rank in its group (its world's RANK). fault: None, or a callable (step, moment)
        called at the moments of FAULT_MOMENTS (the drills' seam: it SIGKILLs this process at the planned one)."""
        self.run_settings, self.group, self.healthy, self.position = run, group, not joining, position
        self.fault = fault or (lambda step, moment: None)
        store = dist.TCPStore(run.store_host, run.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=max(run.join_timeout_s, run.timeout_s)))
        incarnation = uuid.uuid4().hex
        if run.ranks_per_group == 1:  # one process: beat from before the (slow) build, as a slow group's proof
            self.heartbeat = heartbeat_of(run, group, incarnation)
        self.model, self.optimizer = build_stack(run)
        if run.ranks_per_group > 1:  # the group's start is named once, by its rank 0, for all its ranks
            incarnation = comm.all_gather_object(incarnation, comm.world_group())[0]
            self.heartbeat = heartbeat_of(run, group, incarnation, position)
        self.quorum = Quorum(store, group=group, num_groups=run.groups, min_groups=run.min_groups,
                             timeout_s=run.timeout_s, join_timeout_s=run.join_timeout_s,
                             dead_after_s=run.dead_after_s, positions=run.ranks_per_group, position=position,
                             incarnation=incarnation)
        self.link = ReplicaLink(store, group=group, timeout_s=run.timeout_s, position=position)
        self.log = Path(run.log_dir) / f"group{group}.rank{position}.jsonl"

    def run(self) -> None:
        r = self.run_settings
        decision = self._join() if not self.healthy else \
            self._decided(lambda: self.quorum.agree(0, 0, range(r.groups), r.start_timeout_s))
        while True:
            try:
                record, decision = self._step(decision)  # the decision it ended with (a retry's, maybe)
            except Excluded:
                decision = self._join()
                continue
            with open(self.log, "a") as out:
                out.write(json.dumps(asdict(record)) + "\n")
            if decision.step + 1 >= r.steps:
                if self.position == 0:
                    self.quorum.finish()
                return
            try:
                decision = self._decided(lambda: self.quorum.agree(decision.step + 1, 0, decision.members))
            except Excluded:
                decision = self._join()

    def _join(self) -> Decision:
        self.healthy = False
        return self._decided(lambda: self.quorum.join(self.run_settings.join_timeout_s))

    def _decided(self, agree) -> Decision:
        return decided_in_group(agree, ranks=self.run_settings.ranks_per_group, group=self.group, position=self.position)

    def _inside(self, fn):
        return within_group(fn, group=self.group, position=self.position)

    def _step(self, decision: Decision) -> tuple[StepRecord, Decision]:
        started, failed_at, heal_s, healed = time.monotonic(), None, 0.0, False
        packed = None  # float64 [this rank's gradient shard, the group's loss sum, target tokens]: kept for a retry
        while True:
            attempt_start = time.monotonic()
            reduced, ok = None, True
            if decision.joiners:
                ok, seconds = self._heal(decision)
                heal_s += seconds
                healed = healed or (ok and self.group in decision.joiners)
            if ok:
                if packed is None:
                    packed = self._local(decision)
                reduced = self._reduce(decision, packed)
                if self.quorum.outcome(decision, reduced is not None):
                    break
            failed_at = failed_at if failed_at is not None else attempt_start
            if not self.healthy:
                raise Excluded(f"replica group {self.group} lost its heal at step {decision.step}")
            self._inside(lambda: comm.barrier(comm.world_group()) if comm.is_initialized() else None)  # whole?
            decision = self._decided(lambda: self.quorum.agree(decision.step, decision.round + 1, decision.members))
        self.fault(decision.step, "update")  # the others apply this step with this group's samples
        retry_s = attempt_start - failed_at if failed_at is not None else 0.0
        self.model.grad_shard.copy_(reduced[:-2])  # the members' float64 sum, rounded once to fp32
        loss = self._inside(lambda: update(self.model, self.optimizer, reduced[-2:], self.run_settings.lr))
        return StepRecord(step=decision.step, group=self.group, loss=loss, members=list(decision.members),
                          dropped=[g for g in range(self.run_settings.groups) if g not in decision.members],
                          rounds=decision.round + 1, healed=healed, heal_s=heal_s, retry_s=retry_s,
                          step_s=time.monotonic() - started, fingerprint=fingerprint(self.optimizer),
                          rank=self.position), decision

    def _local(self, decision: Decision) -> torch.Tensor:
        self.fault(decision.step, "forward")
        microbatches = self.run_settings.microbatches_of(decision.step, [self.group], self._rank_of_data())
        totals = self._inside(lambda: local_gradient(self.model, self.optimizer, microbatches))
        time.sleep(self.run_settings.step_pause_s)
        return torch.cat([self.model.grad_shard.double(), totals])

    def _rank_of_data(self) -> int | None:
        return self.position if self.run_settings.ranks_per_group > 1 else None

    def _reduce(self, decision: Decision, packed: torch.Tensor) -> torch.Tensor | None:
        """The step's one collective on this position's link; None when a member was lost in it."""
        try:
            if self.link.needs_rebuild(decision):
                self.link.rebuild(decision)
            self.fault(decision.step, "reduction")
            # ONE collective per attempt: with two, a ring can complete the first on one member and
            # fail it on another, which then never joins the second (the first waits out the timeout)
            reduced = packed.clone()
            work = self.link.all_reduce(reduced, async_op=True)
            self.fault(decision.step, "mid-reduction")  # dies with the all-reduce in flight
            self._wait_or_give_up(work, decision, "reduction")
            return reduced
        except RuntimeError:  # a member lost: gloo's closed connection or timeout, a store timeout
            self.link.close()
            return None

    def _wait_or_give_up(self, work, decision: Decision, phase: str) -> None:
        """Wait for a link collective; give it up (RuntimeError) once another member settled the phase's
        outcome (a member settles it only on a failure before all reported): in a ring, a member whose
        neighbour failed and left would otherwise wait for that neighbour until the link's timeout."""
        pause = 0.0005
        while not work.is_completed():
            if self.quorum.failed_already(decision, phase):
                raise RuntimeError(f"step {decision.step}: another member's {phase} failed")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        work.wait()  # raises a failed collective's error

    def _heal_wait(self, work, decision: Decision) -> None:
        self.fault(decision.step, "mid-heal")  # dies with the heal's broadcast in flight (not a chaos moment)
        self._wait_or_give_up(work, decision, "heal")

    def _heal(self, decision: Decision) -> tuple[bool, float]:
        """The decision's heal at this position, then its outcome over every rank of every member; on
        success the parameters are published from the (received) masters inside the group."""
        started, ok = time.monotonic(), True
        try:
            if self.link.needs_rebuild(decision):
                self.link.rebuild(decision)
            heal(self.link, self.optimizer, decision, lambda work: self._heal_wait(work, decision))
        except RuntimeError:
            self.link.close()
            ok = False
        ok = self.quorum.outcome(decision, ok, phase="heal")
        if ok:
            self._inside(self.optimizer.publish_params)  # their own bytes at fp32
            self.healthy = True
        return ok, time.monotonic() - started
