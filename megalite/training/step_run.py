"""One training step as the loop runs it: timed, the learning rate moved on, and its metrics record.

Kept apart from loop.py (the job: set-up, the step loop, checkpoints, evaluation), which calls these
once per step. `job` is the loop's Job.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from megalite import comm
from megalite.config.rampup import BatchRampup
from megalite.data import load_microbatches
from megalite.pipeline.stages import measured_bubble
from megalite.training.metrics import memory_stats
from megalite.training.step import train_step
from megalite.training.step_result import StepResult

if TYPE_CHECKING:
    from megalite.training.loop import Job


def timed_step(job: Job, step: int, indices) -> tuple[StepResult, int, float]:
    """The step, its bytes on the cp group (ring / all-to-all traffic) and its seconds."""
    job.profiler.before_step(step)
    start = time.perf_counter()
    job.timer.reset()
    cp_bytes_before = comm.ledger.total_bytes(group="cp")
    with job.timer.phase("data"):
        microbatches = load_microbatches(job.train_set, indices)
    result = train_step(job.model, job.optimizer, microbatches, job.mesh, job.cfg, None, guard=job.guard,
                        timer=job.timer, graphs=job.graphs)
    if job.cfg.training.rampup_batch_size is None:
        job.scheduler.step()  # result.lr: lr_at(step - 1), set by the scheduler a step ago
    else:  # the schedule follows the samples consumed
        job.scheduler.jump_to(lr_position(job, step))
    cp_comm_bytes = comm.ledger.total_bytes(group="cp") - cp_bytes_before
    job.timer.add_comm_from_ledger()  # host seconds blocked in megalite.comm (all groups)
    if job.mesh.device.type == "cuda":
        torch.cuda.synchronize()
    step_time = time.perf_counter() - start
    job.profiler.after_step(step)
    return result, cp_comm_bytes, step_time


def lr_position(job: Job, steps_done: int) -> float:
    """Where the learning-rate schedule stands after `steps_done` steps: that step count, or under
    --rampup-batch-size the samples consumed in full global batches (Megatron's rule: the schedule counts
    samples, its warm-up and decay steps taken at the full batch; without a ramp the two are equal)."""
    if job.cfg.training.rampup_batch_size is None:
        return steps_done
    return job.sampler.consumed_samples / job.cfg.global_batch_size


def step_record(job: Job, step: int, step_time: float, result: StepResult, cp_comm_bytes: int) -> dict:
    """The metrics record of a logged step: the meter's figures, memory, and what this run adds
    (loss scale, the ramp's batch, MoE statistics, compression, cp bytes, the measured bubble)."""
    cfg = job.cfg
    batch = job.sampler.last_batch_size  # this step's global batch (it grows under --rampup-batch-size)
    ramp = BatchRampup.of(cfg)
    remaining = ramp.samples_in(cfg.training.train_iters - step, job.sampler.consumed_samples) if ramp else None
    record = job.meter.step(step, step_time, samples=batch, remaining_samples=remaining,
                            attention_span=result.attention_span, loss=result.loss, lr=result.lr,
                            grad_norm=result.grad_norm,
                            skipped=result.skipped, exposed_dp_comm_s=result.exposed_dp_comm_s,
                            exposed_grad_reduce_s=result.exposed_grad_reduce_s,
                            exposed_param_gather_s=result.exposed_param_gather_s,
                            exposed_token_count_s=result.exposed_token_count_s,
                            **job.timer.summary(step_time), **memory_stats(job.mesh.device),
                            **job.optimizer.memory_report())
    if cfg.precision.precision == "fp16":
        record["loss_scale"] = result.loss_scale
    record["cp"] = cfg.parallel.cp
    if cfg.training.rampup_batch_size is not None:
        record["global_batch_size"] = batch
    record.update(result.moe)  # aux/z loss, load, drops per layer
    if result.grad_reduce_bytes is not None:  # dp gradient bytes: uncompressed / sent (this step)
        record.update(grad_reduce_bytes=result.grad_reduce_bytes,
                      grad_compression_ratio=result.grad_compression_ratio)
    if cfg.parallel.cp > 1:  # this rank's bytes on its cp group in this step (comm.ledger's convention)
        record.update(cp_comm_type=str(cfg.parallel.cp_comm_type), cp_comm_bytes=cp_comm_bytes)
    bubble = measured_bubble(result.pipeline[1], job.mesh, result.pipeline[0]) if result.pipeline is not None else None
    if bubble is not None:  # the schedule's idle share with this step's measured op times (plot_metrics' time split)
        record["pipeline_bubble"] = bubble
    return record
