"""One replica group of a fault-tolerant run: train, agree every step, survive the others' deaths, heal.

Each replica group is its own process (dp-shard S = 1 within a group: its ZeRO shard is the whole
model) with megalite's own model, DataParallel wrapper and DistributedOptimizer on a one-process
mesh. Nothing static spans the groups: they meet only in the run's store (the quorum, quorum.py) and
on the replica link rebuilt per quorum (replica_link.py). One step:

    1. quorum (k, r)       the live groups (the previous quorum's, within the timeout) + restarted ones
    2. rebuild, heal       a new link when the members changed; restarted groups receive the live state
    3. local gradient      forward + backward of this group's samples of step k, the loss summed
                           (reduction "sum", no scaling): computed once, kept for a retry
    4. reduction           one float64 all-reduce over the link of [gradient, loss sum, target tokens]
    5. outcome (k, r)      ok when every member's reduction completed; else round r + 1 from 1. with
                           the survivors (the dead group's samples of step k are dropped)
    6. update              gradient / surviving tokens, clip, AdamW (the optimizer's own step)

So the step's gradient is the mean over the target tokens of the samples that survived, exactly what
a one-process run on those samples computes (reference.py); every group writes a record of each step
(members, dropped groups, heal, seconds, a fingerprint of its parameters) to <log_dir>/group<g>.jsonl.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.distributed.mesh import single_process_mesh
from megalite.fault_tolerance.quorum import Decision, Excluded, Quorum, beat_key
from megalite.fault_tolerance.replica_link import ReplicaLink, heal
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer


@dataclass
class StepRecord:
    """What one group writes after each step (one JSON line)."""

    step: int
    group: int
    loss: float
    members: list[int]
    dropped: list[int]  # replica groups whose samples of this step were not in its gradient
    rounds: int  # 1 + the retries after a member was lost
    healed: bool  # this group received the live state before this step
    heal_s: float
    retry_s: float  # from the first failed reduction to the start of the one that succeeded
    step_s: float
    fingerprint: str  # sha256 of the fp32 master bytes after the update
    time: float = field(default_factory=time.time)


def build_stack(run: FaultTolerantRun):
    """megalite's model, wrapper and optimizer on a one-process mesh: (DataParallel, DistributedOptimizer)."""
    cfg = run.run_config()
    mesh = single_process_mesh("cpu")
    model = build_data_parallel(build_model_chunks(run.model(), cfg, mesh), cfg, mesh)
    return model, build_optimizer(model, cfg)


def local_gradient(model, optimizer, microbatches) -> torch.Tensor:
    """Forward and backward of `microbatches`, the losses summed unscaled; returns float64 [loss sum,
    target tokens]; the summed gradient is in `model.grad_shard`."""
    optimizer.zero_grad()
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(microbatches):
        model.set_last_microbatch(i == len(microbatches) - 1)
        loss = model(mb["input_ids"], mb["labels"], reduction="sum")
        loss.backward()
        loss_sum += loss.detach().double()
    model.finish_grad_sync(fill_param_grads=False)  # one process: nothing to reduce, the buffers are final
    tokens = sum(int((mb["labels"] != -100).sum()) for mb in microbatches)
    return torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64)])


def update(model, optimizer, totals: torch.Tensor, lr: float) -> float:
    """The summed gradient in `model.grad_shard` / the target tokens, then the optimizer's step (clip,
    AdamW, publish); returns the step's mean loss."""
    loss_sum, tokens = float(totals[0]), float(totals[1])
    model.grad_shard.div_(max(tokens, 1.0))
    optimizer.step(lr=lr)
    return loss_sum / max(tokens, 1.0)


def fingerprint(optimizer) -> str:
    digest = hashlib.sha256()
    for chunk in optimizer.master_chunks():
        digest.update(chunk.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class Heartbeat:
    """A daemon thread adding 1 to this group's beat counter every `period_s`, on its own store
    connection: the quorum waits for a slow group whose counter moves and not for a dead one."""

    def __init__(self, run: FaultTolerantRun, group: int, incarnation: str):
        self.store = dist.TCPStore(run.store_host, run.store_port, is_master=False,
                                   timeout=datetime.timedelta(seconds=run.timeout_s))
        self.key, self.period_s = beat_key(group, incarnation), run.dead_after_s / 5
        threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-{group}").start()

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except RuntimeError:
                return  # the run's store is gone: the run is over
            time.sleep(self.period_s)


FAULT_MOMENTS = ("forward", "reduction", "mid-reduction", "update")


class ReplicaGroup:
    """This process's replica group (module docstring); `run()` trains to the last step."""

    def __init__(self, run: FaultTolerantRun, group: int, *, joining: bool, fault=None):
        """fault: None, or a callable (step, moment) called at the moments of FAULT_MOMENTS (the drills'
        seam: it SIGKILLs this process at the planned one)."""
        self.run_settings, self.group, self.healthy = run, group, not joining
        self.fault = fault or (lambda step, moment: None)
        store = dist.TCPStore(run.store_host, run.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=max(run.join_timeout_s, run.timeout_s)))
        self.quorum = Quorum(store, group=group, num_groups=run.groups, min_groups=run.min_groups,
                             timeout_s=run.timeout_s, join_timeout_s=run.join_timeout_s,
                             dead_after_s=run.dead_after_s)
        self.heartbeat = Heartbeat(run, group, self.quorum.incarnation)  # before the (slow) build
        self.model, self.optimizer = build_stack(run)
        self.link = ReplicaLink(store, group=group, timeout_s=run.timeout_s)
        self.log = Path(run.log_dir) / f"group{group}.jsonl"

    def run(self) -> None:
        r = self.run_settings
        decision = self._join() if not self.healthy else self.quorum.agree(0, 0, range(r.groups), r.start_timeout_s)
        while True:
            try:
                record, decision = self._step(decision)  # the decision it ended with (a retry's, maybe)
            except Excluded:
                decision = self._join()
                continue
            with open(self.log, "a") as out:
                out.write(json.dumps(asdict(record)) + "\n")
            if decision.step + 1 >= r.steps:
                self.quorum.finish()
                return
            try:
                decision = self.quorum.agree(decision.step + 1, 0, decision.members)
            except Excluded:
                decision = self._join()

    def _join(self) -> Decision:
        self.healthy = False
        return self.quorum.join(self.run_settings.join_timeout_s)

    def _step(self, decision: Decision) -> tuple[StepRecord, Decision]:
        started, failed_at, heal_s, healed = time.monotonic(), None, 0.0, False
        packed = None  # float64 [this group's summed gradient, loss sum, target tokens]: kept for a retry
        while True:
            attempt_start = time.monotonic()
            reduced = None
            try:
                if self.link.needs_rebuild(decision):
                    self.link.rebuild(decision)
                if decision.joiners:
                    heal_s += self._heal(decision)
                    healed = healed or self.group in decision.joiners
                if packed is None:
                    self.fault(decision.step, "forward")
                    totals = local_gradient(self.model, self.optimizer,
                                            self.run_settings.microbatches_of(decision.step, [self.group]))
                    packed = torch.cat([self.model.grad_shard.double(), totals])
                    time.sleep(self.run_settings.step_pause_s)
                self.fault(decision.step, "reduction")
                # ONE collective per attempt: with two, a ring can complete the first on one member and
                # fail it on another, which then never joins the second (the first waits out the timeout)
                reduced = packed.clone()
                work = self.link.all_reduce(reduced, async_op=True)
                self.fault(decision.step, "mid-reduction")  # dies with the all-reduce in flight
                self._wait_or_give_up(work, decision)
            except RuntimeError:  # a member lost: gloo's closed connection or timeout, a store timeout
                reduced = None
            if reduced is None:
                self.link.close()
            if self.quorum.outcome(decision, reduced is not None):
                break
            failed_at = failed_at if failed_at is not None else attempt_start
            if not self.healthy:
                raise Excluded(f"replica group {self.group} lost its heal at step {decision.step}")
            decision = self.quorum.agree(decision.step, decision.round + 1, decision.members)
        self.fault(decision.step, "update")  # the others apply this step with this group's samples
        retry_s = attempt_start - failed_at if failed_at is not None else 0.0
        self.model.grad_shard.copy_(reduced[:-2])  # the members' float64 sum, rounded once to fp32
        loss = update(self.model, self.optimizer, reduced[-2:], self.run_settings.lr)
        return StepRecord(step=decision.step, group=self.group, loss=loss, members=list(decision.members),
                          dropped=[g for g in range(self.run_settings.groups) if g not in decision.members],
                          rounds=decision.round + 1, healed=healed, heal_s=heal_s, retry_s=retry_s,
                          step_s=time.monotonic() - started, fingerprint=fingerprint(self.optimizer)), decision

    def _wait_or_give_up(self, work, decision: Decision) -> None:
        """Wait for the all-reduce; give it up (RuntimeError) once another member settled the step's outcome
        (a member settles it only on a failure before all reported): in a ring, a member whose neighbour
        failed and left would otherwise wait for that neighbour until the link's timeout."""
        pause = 0.0005
        while not work.is_completed():
            if self.quorum.failed_already(decision):
                raise RuntimeError(f"step {decision.step}: another member's reduction failed")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        work.wait()  # raises a failed collective's error

    def _heal(self, decision: Decision) -> float:
        started = time.monotonic()
        heal(self.link, self.optimizer, decision)
        self.healthy = True
        return time.monotonic() - started
