"""One training step as the loop runs it: timed, the learning rate moved on, and its metrics record.

Kept apart from loop.py (the job: set-up, the step loop, checkpoints, evaluation), which calls these
once per step with the parts of its Job each one reads.
"""
from __future__ import annotations

import time
import torch

from megalite.distributed import comm
from megalite.config import Precision, RunConfig
from megalite.config.rampup import BatchRampup
from megalite.data import EvalSampler, GlobalBatchSampler, load_microbatches
from megalite.data_parallel.wrapper import DataParallel
from megalite.distributed.mesh import Mesh
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.lr_schedule import ScheduledLR
from megalite.pipeline.stages import measured_bubble
from megalite.training.metrics import memory_stats
from megalite.training.services import Services
from megalite.training.step import evaluate, train_step
from megalite.training.step_result import StepResult


def timed_step(step: int, indices: list[list[int]], *, train_set, model: DataParallel,
               optimizer: DistributedOptimizer, mesh: Mesh, cfg: RunConfig, services: Services,
               graphs=None) -> tuple[StepResult, int, float]:
    """The step, its bytes on the cp group (ring / all-to-all traffic) and its seconds.

    indices: this dp rank's microbatches as sample indices of `train_set` (read in the timed "data"
    phase); graphs: --cuda-graph's StepGraphs or PipelineGraphs (None without). The learning rate
    of the next step is the caller's to set (`advance_lr`)."""
    services.profiler.before_step(step)
    start = time.perf_counter()
    services.timer.reset()
    cp_bytes_before = comm.ledger.total_bytes(group="cp")
    with services.timer.phase("data"):
        microbatches = load_microbatches(train_set, indices)
    result = train_step(model, optimizer, microbatches, mesh, cfg, None, guard=services.guard, timer=services.timer,
                        graphs=graphs)
    cp_comm_bytes = comm.ledger.total_bytes(group="cp") - cp_bytes_before
    services.timer.add_comm_from_ledger()  # host seconds blocked in megalite.distributed.comm (all groups)
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    step_time = time.perf_counter() - start
    services.profiler.after_step(step)
    return result, cp_comm_bytes, step_time


def advance_lr(scheduler: ScheduledLR, cfg: RunConfig, sampler: GlobalBatchSampler, step: int) -> None:
    """The learning rate of the step after `step`: the scheduler's next (result.lr was lr_at(step - 1), set
    a step ago), or under --rampup-batch-size where the samples consumed put the schedule."""
    if cfg.training.rampup_batch_size is None:
        scheduler.step()
    else:
        scheduler.jump_to(lr_position(cfg, sampler, step))


def lr_position(cfg: RunConfig, sampler: GlobalBatchSampler, steps_done: int) -> float:
    """Where the learning-rate schedule stands after `steps_done` steps: that step count, or under
    --rampup-batch-size the samples consumed in full global batches (Megatron's rule: the schedule counts
    samples, its warm-up and decay steps taken at the full batch; without a ramp the two are equal)."""
    if cfg.training.rampup_batch_size is None:
        return steps_done
    return sampler.consumed_samples / cfg.global_batch_size


def step_record(step: int, step_time: float, result: StepResult, cp_comm_bytes: int, *, cfg: RunConfig,
                mesh: Mesh, sampler: GlobalBatchSampler, services: Services, optimizer_memory: dict) -> dict:
    """The metrics record of a logged step: the meter's figures, memory (`optimizer_memory`: the
    optimizer's memory_report()), and what this run adds (loss scale, the ramp's batch, MoE
    statistics, compression, cp bytes, the measured bubble)."""
    batch = sampler.last_batch_size  # this step's global batch (it grows under --rampup-batch-size)
    ramp = BatchRampup.of(cfg)
    remaining = ramp.samples_in(cfg.training.train_iters - step, sampler.consumed_samples) if ramp else None
    record = services.meter.step(step, step_time, samples=batch, remaining_samples=remaining,
                                 attention_span=result.attention_span, loss=result.loss,
                                 lr=result.lr, grad_norm=result.grad_norm, skipped=result.skipped,
                                 exposed_dp_comm_s=result.exposed_dp_comm_s,
                                 exposed_grad_reduce_s=result.exposed_grad_reduce_s,
                                 exposed_param_gather_s=result.exposed_param_gather_s,
                                 exposed_token_count_s=result.exposed_token_count_s,
                                 **services.timer.summary(step_time), **memory_stats(mesh.device), **optimizer_memory)
    if cfg.precision.precision == Precision.FP16:
        record.update(loss_scale=result.loss_scale, skipped_steps=services.guard.skipped_total)
    record["cp"] = cfg.parallel.cp
    if cfg.training.rampup_batch_size is not None:
        record["global_batch_size"] = batch
    record.update(result.moe)  # aux/z loss, load, drops per layer
    record.update(result.mtp)  # each MTP depth's loss
    if result.grad_reduce_bytes is not None:  # dp gradient bytes: uncompressed / sent (this step)
        record.update(grad_reduce_bytes=result.grad_reduce_bytes,
                      grad_compression_ratio=result.grad_compression_ratio)
    if cfg.parallel.cp > 1:  # this rank's bytes on its cp group in this step (comm.ledger's convention)
        record.update(cp_comm_type=str(cfg.parallel.cp_comm_type), cp_comm_bytes=cp_comm_bytes)
    if result.pipeline is not None:  # the schedule's idle share with this step's measured op times (plot_metrics)
        record["pipeline_bubble"] = measured_bubble(result.pipeline.compute_s, mesh, result.pipeline.spec)
    return record


def run_evaluation(job, step: int, log=print) -> None:
    """Evaluate on --eval-iters validation batches (nothing without a validation set) and log the loss; `job`:
    the loop's Job."""
    t = job.cfg.training
    if job.valid_set is None or t.eval_iters == 0:
        return
    batches = EvalSampler(len(job.valid_set), t.eval_iters, job.cfg.global_batch_size, t.micro_batch_size,
                          job.mesh.dp_rank, job.mesh.dp_size)
    microbatches = [mb for indices in batches for mb in load_microbatches(job.valid_set, indices)]
    if not microbatches:
        return
    started = time.perf_counter()
    loss = evaluate(list(job.model.chunks), microbatches, job.mesh, job.cfg)
    job.goodput.add_lost("eval", time.perf_counter() - started)
    log(f"validation at step {step}: loss {loss:.4f} | perplexity {torch.tensor(loss).exp().item():.2f}")
    job.services.writer.write_eval(step, loss)


def continue_at(job, start_step: int) -> int:
    """The step the loop continues after: `start_step`, or (--ft-replica-groups) the live groups' step
    boundary a restarted group was admitted and healed at, the learning rate moved there."""
    if job.replicas is None:
        return start_step
    step = job.replicas.start(start_step)
    if step != start_step:
        job.scheduler.jump_to(lr_position(job.cfg, job.sampler, step))
    return step
