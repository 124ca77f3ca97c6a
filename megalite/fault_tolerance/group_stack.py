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
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.replicas.membership import Heartbeat
from megalite.replicas.quorum import beat_key
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer


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


def heartbeat_of(run: FaultTolerantRun, group: int, incarnation: str, position: int = 0) -> Heartbeat:
    """The runtime's heartbeat of one rank: every dead_after / 5 s on the run's store."""
    return Heartbeat(run.store_host, run.store_port, key=beat_key(group, incarnation, position),
                     period_s=run.dead_after_s / 5, timeout_s=run.timeout_s)
