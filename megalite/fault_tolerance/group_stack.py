"""What one rank of a replica group trains with, shared by the run (replica_group.py) and its reference.

A replica group is its own world of W ranks (`FaultTolerantRun.ranks_per_group`): megalite's model,
DataParallel wrapper and DistributedOptimizer on a mesh of dp = W, ZeRO over the W ranks (dp-shard
S = W), every collective of it static and with the run's timeout. At W = 1 the mesh is one process's.
The group lives or dies whole: a rank whose collective inside its group fails (a sibling was killed:
gloo's closed connection, at once, or the timeout) ends its process (`GroupBroken`), never waits.
"""
from __future__ import annotations

import datetime
import hashlib
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.distributed import comm
from megalite.distributed.mesh import init_mesh, single_process_mesh
from megalite.fault_tolerance.quorum import Decision, Excluded, QuorumLost, RunFinished, beat_key
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer


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


@dataclass
class StepRecord:
    """What each rank of a group writes after each step (one JSON line)."""

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
    fingerprint: str  # sha256 of this rank's fp32 master shard after the update
    rank: int = 0  # the rank's position in its group
    time: float = field(default_factory=time.time)


def build_stack(run: FaultTolerantRun):
    """megalite's model, wrapper and optimizer on this group's mesh: (DataParallel, DistributedOptimizer).
    W > 1: this process is rank RANK of a world of WORLD_SIZE = W (MASTER_ADDR/PORT: the group's store)."""
    cfg = run.run_config()
    if run.ranks_per_group == 1:
        mesh = single_process_mesh("cpu")
    else:
        mesh = init_mesh(dp=run.ranks_per_group, timeout_s=run.timeout_s, device="cpu")
    model = build_data_parallel(build_model_chunks(run.model(), cfg, mesh), cfg, mesh)
    return model, build_optimizer(model, cfg)


def local_gradient(model, optimizer, microbatches) -> torch.Tensor:
    """Forward and backward of this rank's `microbatches`, the losses summed unscaled, the gradients summed
    over the group's ranks (ZeRO's reduce-scatter: this rank's shard in `model.grad_shard`); returns the
    group's float64 [loss sum, target tokens]."""
    optimizer.zero_grad()
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(microbatches):
        model.set_last_microbatch(i == len(microbatches) - 1)
        loss = model(mb["input_ids"], mb["labels"], reduction="sum")
        loss.backward()
        loss_sum += loss.detach().double()
    model.finish_grad_sync(fill_param_grads=False)  # W = 1: nothing to reduce, the buffers are final
    tokens = sum(int((mb["labels"] != -100).sum()) for mb in microbatches)
    totals = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64)])
    if comm.is_initialized():
        comm.all_reduce(totals, comm.world_group())  # the group's world: its W ranks
    return totals


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
    """A daemon thread adding 1 to a rank's beat counter (`key`: quorum.beat_key) every `period_s`, on its
    own connection to the run's store: the quorum waits for a slow group whose ranks' counters all move,
    not for a dead one."""

    def __init__(self, host: str, port: int, *, key: str, period_s: float, timeout_s: float):
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self.key, self.period_s = key, period_s
        threading.Thread(target=self._beat, daemon=True, name=f"heartbeat {key}").start()

    @classmethod
    def of(cls, run: FaultTolerantRun, group: int, incarnation: str, position: int = 0) -> "Heartbeat":
        return cls(run.store_host, run.store_port, key=beat_key(group, incarnation, position),
                   period_s=run.dead_after_s / 5, timeout_s=run.timeout_s)

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except RuntimeError:
                return  # the run's store is gone: the run is over
            time.sleep(self.period_s)
