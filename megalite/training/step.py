"""Build this rank's model chunks and optimizer; run one training step; evaluate.

The loss is normalised once, globally: every microbatch's loss *sum* is scaled by
1 / (target tokens of the whole step, all microbatches and all dp ranks), so gradient
accumulation k and data parallelism n give the gradients of one batch k*n times larger, and
the dp reduction is a plain sum.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from megalite import comm
from megalite.mesh import Mesh
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.pipeline import run_pipeline, stage_layers
from megalite.training.arguments import TrainConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model_chunks(model: GPTConfig, cfg: TrainConfig, mesh: Mesh) -> list[GPTModel]:
    """This rank's model chunks: local chunk c holds model chunk c*pp + pp_rank (one chunk without interleaving)."""
    if mesh.pp_size == 1:
        ranges = [range(model.num_layers)]
    else:
        ranges = stage_layers(model.num_layers, mesh.pp_size, cfg.virtual_stages, mesh.pp_rank,
                              cfg.first_stage_layers, cfg.last_stage_layers)
    chunks = []
    for c, layer_ids in enumerate(ranges):
        first = mesh.pp_rank == 0 and c == 0
        last = mesh.pp_rank == mesh.pp_size - 1 and c == len(ranges) - 1
        chunks.append(GPTModel(model, mesh, layer_ids=layer_ids, pre_process=first, post_process=last,
                               sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute, seed=cfg.seed,
                               fused_linear_cross_entropy=cfg.fused_linear_cross_entropy,
                               recompute_num_layers=cfg.recompute_num_layers,
                               dtype=DTYPES[cfg.precision]))
    return chunks


def build_optimizer(chunks: list[GPTModel], cfg: TrainConfig, mesh: Mesh) -> DistributedOptimizer:
    named = [(chunk.logical_name(n), p) for chunk in chunks for n, p in chunk.named_parameters()]
    scaler = DynamicLossScaler(initial_scale=cfg.initial_loss_scale, growth_interval=cfg.loss_scale_window,
                               hysteresis=cfg.hysteresis, backoff_factor=cfg.loss_scale_backoff) \
        if cfg.precision == "fp16" else None
    optimizer = DistributedOptimizer(named, mesh, zero_stage=cfg.zero, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
                                     bucket_size=cfg.ddp_bucket_size, offload_optimizer=cfg.offload_optimizer,
                                     grad_reduce_dtype=DTYPES[cfg.grad_reduce_dtype], loss_scaler=scaler,
                                     overlap_param_gather=cfg.overlap_param_gather)
    optimizer.install_param_gather_hooks(chunks)  # gather order = forward order; hooks only when overlapping
    return optimizer


def activation_shape(model: GPTConfig, cfg: TrainConfig, seq_length: int) -> tuple[int, int, int]:
    """What crosses a pipeline boundary: [s, b, h], or the sequence shard [s/tp, b, h] under SP."""
    s = seq_length // cfg.tp if cfg.sequence_parallel else seq_length
    return (s, cfg.micro_batch_size, model.hidden_size)


def global_target_tokens(microbatches: list[dict[str, torch.Tensor]], mesh: Mesh) -> float:
    """Target tokens (labels != -100) of the whole step: all microbatches of all dp ranks."""
    local = sum(int((mb["labels"] != -100).sum()) for mb in microbatches)
    count = torch.tensor([float(local)], dtype=torch.float64, device=mesh.device)
    comm.all_reduce(count, mesh.dp_group)
    return float(count.item())


def _global_loss(loss_sum: float, tokens: float, mesh: Mesh) -> float:
    """The step's mean loss over every target token, the same on every rank (one scalar all-reduce)."""
    mine = loss_sum if (mesh.is_last_stage and mesh.tp_rank == 0) else 0.0
    total = torch.tensor([mine], dtype=torch.float64, device=mesh.device)
    comm.all_reduce(total, comm.world_group())
    return float(total.item()) / max(tokens, 1.0)


@contextlib.contextmanager
def _no_timer(name: str):
    yield


def _to_device(microbatches, device):
    return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in microbatches]


def train_step(chunks: list[GPTModel], optimizer: DistributedOptimizer, microbatches: list[dict[str, torch.Tensor]],
               mesh: Mesh, cfg: TrainConfig, lr: float, guard=None, timer=None) -> dict[str, Any]:
    """Forward and backward of every microbatch, dp reduction, clipping, optimizer step.

    guard: a `training.guards.NonFiniteGuard`; a non-finite loss on any rank then skips the
    update on every rank (non-finite gradients are always skipped by the optimizer).
    timer: a `training.metrics.TimeBreakdown` to fill with forward / backward (or, under pp,
    the interleaved "pipeline") / optimizer seconds.
    Returns {'loss': global mean loss, 'grad_norm', 'skipped', 'loss_scale', 'tokens', 'loss_finite',
    'exposed_dp_comm_s'}.
    """
    tokens = global_target_tokens(microbatches, mesh)  # counted where the loader put them (CPU): no GPU sync
    microbatches = _to_device(microbatches, mesh.device)
    scaler = optimizer.loss_scaler
    loss_scale = (scaler.scale if scaler is not None else 1.0) / max(tokens, 1.0)
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.train()
    phase = timer.phase if timer is not None else _no_timer
    if mesh.pp_size == 1:
        # Summed on the device: a float() per microbatch would stall the host on every one.
        model, loss_sum = chunks[0], torch.zeros((), dtype=torch.float32, device=mesh.device)
        for i, mb in enumerate(microbatches):
            # dp reductions start, bucket by bucket, only during the last microbatch's backward
            optimizer.grads.set_last_microbatch(i == len(microbatches) - 1)
            with phase("forward"):
                loss = model(mb["input_ids"], mb["labels"], reduction="sum")
            with phase("backward"):
                (loss * loss_scale).backward()
            loss_sum += loss.detach().float()
    else:
        # Each chunk's buckets start reducing during that chunk's last backward instruction.
        optimizer.grads.set_last_microbatch(False)

        def before_last_backward(chunk: int) -> None:
            optimizer.grads.set_last_microbatch(True, params=list(chunks[chunk].parameters()))

        with phase("pipeline"):  # forward and backward interleaved by the schedule
            loss_sum = run_pipeline(cfg.pipeline_schedule, chunks, microbatches, mesh, len(microbatches),
                                    activation_shape(chunks[0].config, cfg, microbatches[0]["input_ids"].shape[1]),
                                    DTYPES[cfg.precision], loss_scale, virtual_stages=len(chunks),
                                    before_last_backward=before_last_backward)
        optimizer.grads.set_last_microbatch(True)
    loss_sum = float(loss_sum)  # one host sync per step
    loss_finite = guard.loss_is_finite(loss_sum) if guard is not None else True  # one scalar all-reduce
    with phase("optimizer"):
        result = optimizer.step(lr, skip=not loss_finite)
    result["exposed_dp_comm_s"] = optimizer.exposed_comm_seconds()  # inside the optimizer phase
    result["loss_finite"] = loss_finite
    result["loss"] = _global_loss(loss_sum, tokens, mesh)
    result["tokens"] = tokens
    return result


@torch.no_grad()
def evaluate(chunks: list[GPTModel], microbatches: list[dict[str, torch.Tensor]], mesh: Mesh,
             cfg: TrainConfig) -> float:
    """Mean loss over every target token of `microbatches` (all dp ranks), the same on every rank.

    Forward only; with pipeline parallelism the schedule's forward-only variant runs.
    """
    tokens = global_target_tokens(microbatches, mesh)  # counted where the loader put them (CPU): no GPU sync
    microbatches = _to_device(microbatches, mesh.device)
    for chunk in chunks:
        chunk.eval()
    if mesh.pp_size == 1:
        loss_sum = sum(float(chunks[0](mb["input_ids"], mb["labels"], reduction="sum")) for mb in microbatches)
    else:
        shape = activation_shape(chunks[0].config, cfg, microbatches[0]["input_ids"].shape[1])
        loss_sum = run_pipeline(cfg.pipeline_schedule, chunks, microbatches, mesh, len(microbatches), shape,
                                DTYPES[cfg.precision], 1.0, virtual_stages=len(chunks), forward_only=True)
    return _global_loss(loss_sum, tokens, mesh)
