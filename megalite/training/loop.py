"""The whole training job, in the library: `main(argv)` is examples/pretrain_gpt.py.

    configure: flags (+ --config file) -> RunConfig, resolved for this world and validated on
               every rank before any process group exists (a mistake: one message, exit code 2)
    build:     mesh -> data -> this rank's model chunks -> DataParallel -> optimizer -> metrics,
               guards, hang watchdog, profiler, checkpointer, preemption handler
    resume:    weights, optimizer, data position, step and RNG from the newest intact checkpoint; on a
               world of another size, dp re-derived and the batch kept or scaled (--elastic-batch),
               planned from the checkpoint's metadata before any process group exists
    train:     steps; periodic evaluation and checkpoints; SIGTERM/SIGUSR1 save and stop
    finish:    the last checkpoint and evaluation

Every resource (process group, background checkpoint write, watchdog thread, profiler,
metrics files, signal handlers) is registered on an ExitStack as it is acquired and released
in reverse order when the job ends, whether it returns, raises or is interrupted (Ctrl-C).
A clean end waits for the last checkpoint write and meets the other ranks at a barrier; an
exception releases everything without communicating (the other ranks may be gone).

Exit codes: 0 done (or stopped by a signal after saving), 2 a user's mistake (`UsageError`: the
configuration, a config file, the data, a checkpoint of another model, a checkpoint directory
that cannot be written; printed once per node without a traceback), 3 stopped on a non-finite
loss or gradient (--on-nonfinite stop), 4 replicas differ, 86 hang (the watchdog).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.distributed import comm
from megalite.checkpoint import load_checkpoint, maybe_inject_fault
from megalite.checkpoint.lock import CheckpointLock
from megalite.checkpoint.preemption import SetupInterrupted, end_with_the_launcher, interrupt_during_setup
from megalite.checkpoint.elastic import (STATE_KEY as ELASTIC_STATE_KEY, ElasticState, ResumePlan, elastic_fields,
                                         plan_resume)
from megalite.checkpoint.finetune import checkpoint_start
from megalite.checkpoint.resume_settings import check_resumed_settings
from megalite.cli import given_settings, parse_args, to_toml
from megalite.config import RunConfig, SFTOverlong
from megalite.config.rampup import BatchRampup
from megalite.data.sft_dataset import build_sft_datasets
from megalite.data.documents import DocumentFields
from megalite.data import GlobalBatchSampler, build_gpt_datasets, build_mock_datasets, load_tokenizer
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset
from megalite.data.mock_dataset import MockDataset
from megalite.data_parallel.wrapper import DataParallel
from megalite.errors import UsageError, report_usage_error
from megalite.training.compile import compile_blocks
from megalite.training.cuda_graph import StepGraphs
from megalite.training.pipeline_graphs import PipelineGraphs
from megalite.distributed.mesh import Mesh, destroy_mesh, init_mesh
from megalite.config.model import GPTConfig
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.lr_schedule import LRSchedule, ScheduledLR
from megalite.plan import estimate
from megalite.training.goodput import GoodputLedger
from megalite.training.guards import (NONFINITE_EXIT_CODE, REPLICA_MISMATCH_EXIT_CODE, NonFiniteError,
                                      ReplicaMismatchError, check_replicas)
from megalite.training.metrics import estimate_vs_measured, gather_step_times, progress_line, straggler_report
from megalite.training.configure import configure, training_vocabulary
from megalite.training.launch_checks import memory_per_rank
from megalite.training.advice import Advisor
from megalite.training.announce import announce, attention_run
from megalite.training.dry_run import dry_run_report
from megalite.training.provided_model import ProvidedModel, default_loss
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer
from megalite.training.step_result import StepResult
from megalite.training.run_limits import exit_reason, refuse_foreign_checkpoints
from megalite.training.services import Services, on_exit, open_services
from megalite.training.step_run import advance_lr, continue_at, lr_position, run_evaluation, step_record, timed_step
from megalite.replicas.trainer import REPLICA_ENDS, ReplicaTraining, end_in_one_line, sampler_place


def log(*parts, rank0_only: bool = True) -> None:
    if not rank0_only or int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------
# Configure
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, provided=None) -> int:
    """Parse, validate and run; a user's mistake prints its message (no traceback) and returns 2.
    `provided`: a user's model in place of GPTModel (megalite.training.provided.main builds it)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        # no step boundary yet to stop at: a signal ends the run now; an orphaned worker stops itself
        with interrupt_during_setup(), end_with_the_launcher():
            return _configure_and_train(argv, provided)
    except UsageError as exc:  # raised on every rank together (before any collective, or agreed)
        return report_usage_error(exc, rank)
    except SetupInterrupted as exc:  # once per node, as a UsageError
        if rank == 0 or int(os.environ.get("LOCAL_RANK", rank)) == 0:
            print(f"megalite: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def _configure_and_train(argv: list[str] | None, provided=None) -> int:
    """main's work: the configuration, --print-config / --dry-run, or the run."""
    cfg, actions = parse_args(argv)  # refuses values outside their declared bounds
    if actions["simulate"]:  # chosen above the loop, where the simulator is (megalite/commands.py)
        raise UsageError("--simulate is an action of examples/pretrain_gpt.py (megalite.commands.main), which runs "
                         "the GPT of the flags on a fake world; run it there")
    launching = not (actions["dry_run"] or actions["print_config"])
    # a dry run or --print-config on one process shows the layout the flags name (its world: tp*cp*pp*dp)
    world_size = int(os.environ.get("WORLD_SIZE", "0")) or (1 if launching else cfg.world_size)
    given = given_settings(argv)
    # --finetune's start; --load's checkpoint decides the model's shape (a shape flag must agree with it)
    cfg, notes = checkpoint_start(cfg, given, own_model=provided is not None)
    # --load's checkpoint decides the batch (and, on another world, the layout) before any process group
    plan = ResumePlan.fresh(cfg) if actions["dry_run"] else plan_resume(cfg, world_size, given)
    cfg = plan.cfg
    if provided is not None:  # before the GPT-shaped checks, which would name GPT's flags
        provided.check(cfg, dry_run=actions["dry_run"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab, note = training_vocabulary(cfg, None if cfg.data.mock_data else tokenizer.vocab_size,
                                      preset_given="model" in given)  # mock data: the model's own vocabulary
    cfg = configure(cfg, world_size, vocab, memory=memory_per_rank() if launching else None)
    if actions["print_config"]:
        print(to_toml(cfg, cfg.derived()), end="")
        return 0
    if actions["dry_run"]:
        print(dry_run_report(cfg))
        return 0
    _resumed_settings(cfg, plan.step, plan.metadata, plan, provided is None)  # refusals now; the notice at load
    for line in notes + plan.messages() + ([note] if note else []):
        log(line)
    return train(cfg, tokenizer, plan, provided=provided)


def _resumed_settings(cfg: RunConfig, step: int | None, metadata: dict | None, plan: ResumePlan,
                      gpt: bool = True) -> list[str]:
    """The differences from the run of checkpoint `step`, named (ConfigError for the unaccepted ones);
    `gpt`: the run trains GPTModel (a user's model is not described by the model flags)."""
    if metadata is None or not isinstance(metadata.get("train_config"), dict):
        return []
    saved_state = ElasticState.from_metadata(metadata)
    return check_resumed_settings(cfg, step, metadata["train_config"], plan.state.lr_factor,
                                  saved_state.lr_factor if saved_state else 1.0,
                                  saved_model=metadata.get("model_config") if gpt else None)


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


Samples = GPTDataset | BlendedDataset | MockDataset  # what load_microbatches reads a step's samples from


@dataclass
class Job:
    """Everything one rank's training job holds (built by `build_job`)."""

    cfg: RunConfig
    model_cfg: GPTConfig
    mesh: Mesh
    train_set: Samples
    valid_set: Samples | None
    sampler: GlobalBatchSampler
    chunks: list[nn.Module]  # this rank's model chunks (GPTModel, or a provided model's)
    model: DataParallel
    optimizer: DistributedOptimizer
    lr_at: LRSchedule
    scheduler: ScheduledLR  # lr_at driving the optimizer's param groups (torch's LR scheduler)
    services: Services  # metrics, profiler, guard, watchdog, checkpointer, preemption
    last_saved: int = 0
    resume_plan: ResumePlan | None = None  # what --load's checkpoint decided (elastic resize)
    graphs: StepGraphs | PipelineGraphs | None = None  # --cuda-graph: the captured microbatches (chunks at pp > 1)
    advisor: Advisor = field(default_factory=lambda: Advisor(print_fn=log))  # advice once, when it applies
    provided: ProvidedModel | None = None  # a user's model in place of GPTModel
    goodput: GoodputLedger = field(default_factory=lambda: GoodputLedger(None, write=False))  # training/goodput.py
    replicas: ReplicaTraining | None = None  # --ft-replica-groups: this job is one replica group (fault_tolerance/)


def build_job(cfg: RunConfig, tokenizer, resources: contextlib.ExitStack, provided=None) -> Job:
    """Mesh, data, model, optimizer and the run's services; each registered on `resources`."""
    p = cfg.parallel
    mesh = init_mesh(layout=cfg.layout())
    on_exit(resources, lambda clean: destroy_mesh())
    if cfg.checkpoint.save:  # one run per --save directory: every rank refuses when another run holds it
        lock = CheckpointLock(cfg.checkpoint.save, log=log)
        comm.agreed(lambda: lock.acquire() if mesh.rank == 0 else None, comm.world_group())
        on_exit(resources, lambda clean: lock.release())
    torch.manual_seed(cfg.training.seed)
    chunks = provided.build_chunks(cfg, mesh) if provided is not None else None  # the same seed on every rank
    model_cfg = chunks[0].config if provided is not None else cfg.gpt_config()
    if provided is None:
        announce(cfg, model_cfg, mesh, log)
    else:
        log(mesh.describe() + "\n" + model_cfg.describe())
    t = cfg.training
    if cfg.data.mock_data:  # synthetic ids over the true vocabulary; nothing to read, nothing to agree on
        train_set, valid_set, _ = build_mock_datasets(model_cfg.vocab_size, model_cfg.seq_length, t.seed,
                                                      cfg.data.split)
    else:  # data may sit on node-local disks: every rank learns if any rank cannot read it
        path, d = list(cfg.data.data_path) if cfg.data.data_path else None, cfg.data
        documents = DocumentFields(d.reset_position_ids, d.eod_mask_loss)  # data/documents.py
        train_set, valid_set, _ = comm.agreed(lambda: build_sft_datasets(
            path, d.split, model_cfg.seq_length, t.seed, tokenizer, packing=d.sft_packing,
            truncate=d.sft_overlong == SFTOverlong.TRUNCATE) if d.sft else build_gpt_datasets(
            path, d.split, model_cfg.seq_length, t.seed, tokenizer, documents=documents), comm.world_group())
    ramp = BatchRampup.of(cfg)  # --rampup-batch-size: each step's batch from the samples consumed before it
    sampler = GlobalBatchSampler(len(train_set), *sampler_place(cfg, mesh),  # --ft-replica-groups: the group's share
                                 seed=t.seed, batch_size_at=ramp.batch_size_at if ramp else None)
    if cfg.data.mock_data:  # an unbounded stream (2^40 indices): what the run reads, not the index space
        log(f"data: --mock-data: synthetic ids over the vocabulary of {model_cfg.vocab_size}, samples of "
            f"{model_cfg.seq_length} tokens ({t.train_iters * cfg.global_batch_size} read by --train-iters "
            f"{t.train_iters})")
    else:
        log(f"data: {len(train_set)} training samples of {model_cfg.seq_length} tokens"
            + (f", {len(valid_set)} validation" if valid_set is not None else ""))
    chunks = chunks or build_model_chunks(model_cfg, cfg, mesh)
    if t.compile:  # in place: the parameters and their names unchanged (megalite/training/compile.py)
        log(f"compile: {compile_blocks(chunks)} blocks with torch.compile (the first steps include compilation)")
    model = build_data_parallel(chunks, cfg, mesh)
    optimizer = build_optimizer(model, cfg)
    o = cfg.optimizer
    lr_at = LRSchedule(o.lr, o.min_lr, *cfg.lr_schedule_iters, o.lr_decay_style,  # (warm-up, decay) steps
                       wsd_decay_iters=o.lr_wsd_decay_iters or 0, wsd_style=o.lr_wsd_decay_style)
    job = Job(cfg=cfg, model_cfg=model_cfg, mesh=mesh, train_set=train_set, valid_set=valid_set, sampler=sampler,
              chunks=chunks, model=model, optimizer=optimizer, lr_at=lr_at, scheduler=ScheduledLR(optimizer, lr_at),
              services=open_services(cfg, model_cfg, mesh, resources, log=log), provided=provided)
    job.replicas = ReplicaTraining.of(cfg, model=model, optimizer=optimizer, sampler=sampler, log=log)
    if t.cuda_graph:
        job.graphs = StepGraphs(model) if mesh.pp_size == 1 else PipelineGraphs(model, mesh)
    return job


# ---------------------------------------------------------------------------------------------
# Resume, train, finish
# ---------------------------------------------------------------------------------------------


def train(cfg: RunConfig, tokenizer=None, resume_plan: ResumePlan | None = None, *, model_provider=None,
          loss_fn=None, provided=None) -> int:
    """Run the job of a validated, resolved configuration; returns the process exit code.
    `resume_plan`: `plan_resume`'s (main makes it; without one, the configuration as it is).
    `model_provider`, `loss_fn`: a user's model in place of GPTModel (docs/own_model.md,
    megalite/training/provided.py); `provided`: both, already checked (provided.main makes it)."""
    if model_provider is not None:
        provided = ProvidedModel(model_provider, loss_fn or default_loss)
        provided.check(cfg)
    refuse_foreign_checkpoints(cfg, resume_plan)  # every rank, before any process group
    with contextlib.ExitStack() as resources:
        with interrupt_during_setup():  # until the first step a signal ends the run at once
            job = build_job(cfg, tokenizer or load_tokenizer(cfg.data.tokenizer), resources, provided)
            job.resume_plan = resume_plan or ResumePlan.fresh(cfg)
            job.goodput = GoodputLedger(cfg.checkpoint.save, write=job.mesh.rank == 0)  # the job's history so far
            start_step = resume(job)
        job.services.preemption.install()  # from here a signal saves at the next step boundary
        try:
            start_step = continue_at(job, start_step)  # --ft-replica-groups: a restarted group heals, no load
            stopped = train_steps(job, start_step)
        except (NonFiniteError, ReplicaMismatchError) as exc:  # raised on every rank together
            print(f"megalite (rank {job.mesh.rank}): {exc}", file=sys.stderr, flush=True)
            return NONFINITE_EXIT_CODE if isinstance(exc, NonFiniteError) else REPLICA_MISMATCH_EXIT_CODE
        except REPLICA_ENDS as exc:  # the quorum lost, this group broken, the run over before it rejoined
            return end_in_one_line(exc, job.mesh.rank)
        if not stopped and start_step < cfg.training.train_iters:
            save(job, cfg.training.train_iters)
            every = cfg.training.eval_interval
            if not (every and cfg.training.train_iters % every == 0):  # else just evaluated
                run_evaluation(job, cfg.training.train_iters, log)
        return 0


def resume(job: Job) -> int:
    """Load the newest intact checkpoint of --load (any layout); returns the step to continue after."""
    ck = job.cfg.checkpoint
    if not ck.load:
        return 0
    weights_only = ck.no_load_optim or ck.finetune  # --finetune: fresh RNG streams too (Megatron's)
    started = time.perf_counter()
    resumed = load_checkpoint(ck.load, job.chunks, job.optimizer, job.mesh, step=ck.load_step,
                              load_optimizer=not weights_only, load_rng=not ck.finetune, log=log)
    job.goodput.add_lost("reload", time.perf_counter() - started)
    start_step = 0
    if resumed is not None and not weights_only:
        start_step = resumed.step
        job.sampler.load_state_dict({"consumed_samples": resumed.consumed_samples})
        _record_resize(job, resumed)
        # the notice names the step that loaded (an older one when the newest was damaged)
        for line in _resumed_settings(job.cfg, resumed.step, resumed.metadata, job.resume_plan, job.provided is None):
            log(line)
    job.last_saved = start_step
    job.goodput.resumed_at(start_step)  # the previous run's steps after it are replayed
    job.scheduler.jump_to(lr_position(job.cfg, job.sampler, start_step))  # the lr of step start_step + 1
    if job.services.watchdog:
        job.services.watchdog.progress(start_step)  # loading a large checkpoint is progress, not a hang
    if start_step >= job.cfg.training.train_iters:
        log(f"the checkpoint is at step {start_step} >= --train-iters {job.cfg.training.train_iters}: nothing to "
            f"train")
    return start_step


def _record_resize(job: Job, resumed) -> None:
    """The metrics line of a world-size change; refuses a fallback checkpoint the plan was not made from."""
    plan = job.resume_plan
    if plan.metadata is not None and resumed.step != plan.step \
            and elastic_fields(resumed.metadata) != elastic_fields(plan.metadata):
        raise UsageError(f"checkpoint step {plan.step} is damaged and the intact step {resumed.step} it fell back "
                         f"to was saved on another world or batch, which this run was not planned for; relaunch "
                         f"with --load-step {resumed.step}")
    if plan.resize is not None:
        job.services.writer.write_event(dataclasses.replace(plan.resize, step=resumed.step).record())


def train_steps(job: Job, start_step: int) -> bool:
    """Steps start_step+1 .. train_iters; True when a signal stopped the run early (after saving)."""
    cfg, started = job.cfg, time.monotonic()  # --exit-duration-in-mins counts from here
    for step, indices in zip(range(start_step + 1, cfg.training.train_iters + 1), job.sampler):
        maybe_inject_fault(step, job.mesh.rank)  # MEGALITE_FAULT_AT_STEP: restart tests only
        if job.replicas is not None:  # the step's quorum of replica groups (and a heal)
            job.replicas.begin_step(step)
        result, cp_comm_bytes, step_time = timed_step(step, indices, train_set=job.train_set, model=job.model,
                                                      optimizer=job.optimizer, mesh=job.mesh, cfg=cfg,
                                                      services=job.services, graphs=job.graphs)
        job.goodput.step_done(step, step_time)
        advance_lr(job.scheduler, cfg, job.sampler, step)
        job.services.guard.check(step, result, indices)  # logs the step's global sample indices; raises under 'stop'
        interval = cfg.fault_tolerance.check_replicas_interval
        if interval and step % interval == 0:
            job.model.wait_for_params()  # --overlap-param-gather leaves the gathers in flight
            if cfg.parallel.zero == 3:  # no dp replicas: compare the tp ranks' shard pieces
                check_replicas(job.model.tp_replicated_pieces(), job.mesh, step, shards=True,
                               replica_pieces=job.model.shard_pieces())  # hybrid: and the replica groups
            else:
                check_replicas([(n, p) for c in job.chunks for n, p in c.logical_parameters()], job.mesh, step)
        if step == start_step + 1 and job.provided is None:  # the planner models GPTModel
            planned = estimate(job.model_cfg, cfg, attention_run(cfg, job.model_cfg, job.mesh.device))
            log(estimate_vs_measured(planned, job.mesh.device))
        _record(job, step, step_time, result, cp_comm_bytes)
        if cfg.logging.straggler_interval and step % cfg.logging.straggler_interval == 0:
            times, hosts = gather_step_times(step_time)
            log(straggler_report(times, hosts).describe())
        if cfg.training.eval_interval and step % cfg.training.eval_interval == 0:
            run_evaluation(job, step, log)
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            save(job, step)
        if job.services.watchdog:
            job.services.watchdog.progress(step)  # a finished step (evaluation and checkpoint included)
        preemption = job.services.preemption
        reason = preemption.agreed_signal if preemption.should_stop(step) else exit_reason(cfg, step, started, job.mesh)
        if reason:
            save(job, step)
            log(f"megalite: {reason}: stopped after step {step}"
                + (f", saved; resume with --load {cfg.checkpoint.save}" if cfg.checkpoint.save else " (no --save)"))
            return True
    if job.replicas is not None:
        job.replicas.finish()
    return False


def _record(job: Job, step: int, step_time: float, result: StepResult, cp_comm_bytes: int) -> None:
    """The metrics record and progress line of a logged step."""
    cfg = job.cfg
    if not (step % cfg.logging.log_interval == 0 or step == 1 or step == cfg.training.train_iters):
        return
    record = {**step_record(step, step_time, result, cp_comm_bytes, cfg=cfg, mesh=job.mesh, sampler=job.sampler,
                            services=job.services, optimizer_memory=job.optimizer.memory_report()),
              **job.goodput.fields(), **(job.replicas.fields() if job.replicas is not None else {})}
    job.services.writer.write(record)
    log(progress_line(record) + job.goodput.describe() + (" (skipped: non-finite gradients)" if result.skipped else ""))
    job.goodput.persist()
    job.advisor.observe(step_time, pipeline_bubble=record.get("pipeline_bubble"),
                        exposed_dp_comm_s=result.exposed_dp_comm_s, pp=job.mesh.pp_size,
                        dp=job.mesh.dp_size * job.mesh.cp_size)


def save(job: Job, step: int) -> None:
    """Checkpoint the state after `step` (once per step), with the resolved configuration inside."""
    if job.services.checkpointer is None or job.last_saved == step:
        return
    started = time.perf_counter()
    job.model.wait_for_params()
    job.services.checkpointer.save(step, job.chunks, job.optimizer, consumed_samples=job.sampler.consumed_samples,
                                   model_config=job.model_cfg, train_config=job.cfg.to_dict(),
                                   extra={ELASTIC_STATE_KEY: (job.resume_plan or ResumePlan.fresh(job.cfg)).state.to_dict()})
    job.last_saved = step
    job.goodput.add_lost("save", time.perf_counter() - started)  # training blocked (async: the snapshot)


if __name__ == "__main__":  # python -m megalite.training.loop: a training run (--simulate is megalite.commands')
    sys.exit(main())
