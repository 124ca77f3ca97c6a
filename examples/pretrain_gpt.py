"""Pretrain a GPT with tensor x pipeline x data parallelism.

    python examples/pretrain_gpt.py                                   # tiny GPT, embedded corpus, CPU ok
    torchrun --nproc_per_node 8 examples/pretrain_gpt.py --tp 2 --pp 2 --dp 2
    torchrun ... examples/pretrain_gpt.py --model gpt2-124m --data-path my_corpus_text_document --bf16

Reads top to bottom: flags -> configuration checked before any process group exists ->
mesh -> data -> this rank's model chunks -> optimizer -> resume from a checkpoint -> the
training loop (periodic checkpoints; SIGTERM/SIGUSR1 save and stop) -> evaluation.

Preemptible, restartable runs use one command line for the first start and every restart:

    torchrun --max-restarts 3 ... examples/pretrain_gpt.py --save ckpt --load ckpt --save-interval 100
"""
from __future__ import annotations

import os
import sys
import time

import torch

from megalite import comm
from megalite.checkpoint import Checkpointer, PreemptionHandler, load_checkpoint, maybe_inject_fault
from megalite.data import EvalSampler, GlobalBatchSampler, build_gpt_datasets, load_microbatches, load_tokenizer
from megalite.mesh import destroy_mesh, init_mesh
from megalite.optim.lr_schedule import LRSchedule
from megalite.training.arguments import ConfigError, build_parser, planner_layout, resolve
from megalite.training.estimate import estimate
from megalite.training.guards import (NONFINITE_EXIT_CODE, REPLICA_MISMATCH_EXIT_CODE, NonFiniteError, NonFiniteGuard,
                                      ReplicaMismatchError, check_replicas)
from megalite.training.metrics import (MetricsWriter, ThroughputMeter, estimate_vs_measured, gather_step_times,
                                       memory_stats, TimeBreakdown,
                                       peak_tflops, progress_line, straggler_report)
from megalite.training.planner import justify
from megalite.training.profiling import StepProfiler
from megalite.training.run_layout import recompute_fraction
from megalite.training.step import build_model_chunks, build_optimizer, evaluate, train_step
from megalite.training.watchdog import HangWatchdog


def log(*parts, rank0_only: bool = True) -> None:
    if not rank0_only or int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


def main(argv: list[str] | None = None) -> int:
    # 1. Flags and the configuration, validated on every rank before any collective exists.
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "0")) or (args.tp * args.pp * (args.dp or 1) if args.dry_run else 1)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        model_cfg, cfg = resolve(args, world_size, tokenizer.vocab_size)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megalite: configuration error (rank {os.environ.get('RANK', '0')}):\n{exc}", file=sys.stderr)
        return 2
    plan = estimate(model_cfg, planner_layout(model_cfg, cfg))
    if cfg.dry_run:
        print(plan.describe())
        return 0

    # 2. The mesh: process groups in Megatron order (tp fastest, then dp, then pp).
    mesh = init_mesh(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    torch.manual_seed(cfg.seed)
    log(mesh.describe())
    log(f"model: {model_cfg.flavour} {model_cfg.num_layers} layers, h={model_cfg.hidden_size}, "
        f"heads={model_cfg.num_attention_heads}/{model_cfg.num_query_groups}, {model_cfg.num_params() / 1e6:.2f}M "
        f"params, vocab {model_cfg.vocab_size} (padded {model_cfg.padded_vocab_size(cfg.tp)}), seq {model_cfg.seq_length}")
    log(f"batch: global {cfg.global_batch_size} = micro {cfg.micro_batch_size} x dp {cfg.dp} x accumulation "
        f"{cfg.num_microbatches}; {cfg.precision}; schedule {cfg.pipeline_schedule if cfg.pp > 1 else 'none'}; "
        f"zero {cfg.zero}; estimated {plan.total_bytes / 1e9:.2f} GB per rank")
    log("layout: " + justify(model_cfg, planner_layout(model_cfg, cfg),
                             gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    # 3. Data: fixed-length samples addressed by a global index; each dp rank reads its share.
    train_set, valid_set, _ = build_gpt_datasets(cfg.data_path, cfg.split, model_cfg.seq_length, cfg.seed, tokenizer)
    sampler = GlobalBatchSampler(len(train_set), cfg.global_batch_size, cfg.micro_batch_size, mesh.dp_rank,
                                 mesh.dp_size, seed=cfg.seed)
    log(f"data: {len(train_set)} training samples of {model_cfg.seq_length} tokens"
        + (f", {len(valid_set)} validation" if valid_set is not None else ""))

    # 4. This rank's model chunks (only its layers) and the sharded optimizer.
    chunks = build_model_chunks(model_cfg, cfg, mesh)
    optimizer = build_optimizer(chunks, cfg, mesh)
    lr_at = LRSchedule(cfg.lr, cfg.min_lr, cfg.lr_warmup_iters, cfg.train_iters, cfg.lr_decay_style)
    meter = ThroughputMeter(model_cfg, model_cfg.seq_length, cfg.micro_batch_size, cfg.dp, cfg.num_microbatches,
                            mesh.world_size, cfg.recompute, cfg.train_iters,
                            cfg.peak_tflops or peak_tflops(torch.cuda.get_device_name() if mesh.device.type == "cuda"
                                                           else None, cfg.precision),
                            recompute_fraction=recompute_fraction(model_cfg, planner_layout(model_cfg, cfg)))
    writer = MetricsWriter(cfg.metrics_file, cfg.tensorboard_dir, enabled=mesh.rank == 0)
    timer = TimeBreakdown()  # per-step seconds: data, forward, backward (or pipeline), optimizer, comm
    profiler = StepProfiler(cfg.profile_steps, cfg.profile_dir, mesh.rank, mesh.device, log=log)
    # Guards: a non-finite loss or gradient skips the update (or stops); dp replicas must not drift.
    guard = NonFiniteGuard(mesh, cfg.on_nonfinite, loss_scaling=cfg.precision == "fp16", log=log)
    named_params = [(name, p) for chunk in chunks for name, p in chunk.logical_parameters()]
    # Hang watchdog: no finished step for --hang-timeout s -> every rank reports where it waits, exit 86.
    watchdog = HangWatchdog(cfg.hang_timeout, cfg.hang_report_dir, mesh=mesh).start() if cfg.hang_timeout else None

    # 5. Resume: weights, optimizer state, data position (consumed samples), step (hence the LR)
    #    and RNG states from the newest intact checkpoint, saved under any layout.
    start_step = 0
    if cfg.load:
        resumed = load_checkpoint(cfg.load, chunks, optimizer, mesh, step=cfg.load_step,
                                  load_optimizer=not cfg.no_load_optim, log=log)
        if resumed is not None and not cfg.no_load_optim:
            start_step = resumed.step
            sampler.load_state_dict({"consumed_samples": resumed.consumed_samples})
        if watchdog:
            watchdog.progress(start_step)  # loading a large checkpoint is progress, not a hang
    checkpointer = Checkpointer(cfg.save, mesh, keep_last=cfg.keep_last, keep_every=cfg.keep_every,
                                async_save=cfg.async_save, log=log) if cfg.save else None
    preemption = PreemptionHandler(mesh)  # SIGTERM/SIGUSR1: every rank stops after the same step
    last_saved = start_step

    def save(step: int) -> None:
        nonlocal last_saved
        if checkpointer is not None and last_saved != step:
            checkpointer.save(step, chunks, optimizer, consumed_samples=sampler.consumed_samples,
                              model_config=model_cfg, train_config=cfg)
            last_saved = step

    def run_eval(step: int) -> None:
        if valid_set is None or cfg.eval_iters == 0:
            return
        batches = EvalSampler(len(valid_set), cfg.eval_iters, cfg.global_batch_size, cfg.micro_batch_size,
                              mesh.dp_rank, mesh.dp_size)
        microbatches = [mb for indices in batches for mb in load_microbatches(valid_set, indices)]
        if not microbatches:
            return
        loss = evaluate(chunks, microbatches, mesh, cfg)
        log(f"validation at step {step}: loss {loss:.4f} | perplexity {torch.tensor(loss).exp().item():.2f}")
        writer.write_eval(step, loss)

    # 6. The training loop.
    if start_step >= cfg.train_iters:
        log(f"the checkpoint is at step {start_step} >= --train-iters {cfg.train_iters}: nothing to train")
    stopped = False
    for step, indices in zip(range(start_step + 1, cfg.train_iters + 1), sampler):
        maybe_inject_fault(step, mesh.rank)  # MEGALITE_FAULT_AT_STEP: restart tests only
        profiler.before_step(step)
        start = time.perf_counter()
        timer.reset()
        with timer.phase("data"):
            microbatches = load_microbatches(train_set, indices)
        lr = lr_at(step - 1)
        result = train_step(chunks, optimizer, microbatches, mesh, cfg, lr, guard=guard, timer=timer)
        timer.add_comm_from_ledger()  # host seconds blocked in megalite.comm (all groups)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        profiler.after_step(step)
        try:
            guard.check(step, result, indices)  # logs the step's global sample indices; raises under 'stop'
            if cfg.check_replicas_interval and step % cfg.check_replicas_interval == 0:
                optimizer.wait_for_params()  # --overlap-param-gather leaves the gathers in flight
                check_replicas(named_params, mesh, step)
        except (NonFiniteError, ReplicaMismatchError) as exc:  # raised on every rank together
            print(f"megalite (rank {mesh.rank}): {exc}", file=sys.stderr, flush=True)
            profiler.close()
            if watchdog:
                watchdog.stop()
            destroy_mesh()
            return NONFINITE_EXIT_CODE if isinstance(exc, NonFiniteError) else REPLICA_MISMATCH_EXIT_CODE
        if step == start_step + 1:
            log(estimate_vs_measured(plan, mesh.device))
        if step % cfg.log_interval == 0 or step == 1 or step == cfg.train_iters:
            record = meter.step(step, step_time, loss=result["loss"], lr=lr, grad_norm=result["grad_norm"],
                                skipped=result["skipped"], exposed_dp_comm_s=result["exposed_dp_comm_s"],
                                **timer.summary(step_time), **memory_stats(mesh.device),
                                **optimizer.memory_report())
            if cfg.precision == "fp16":
                record["loss_scale"] = result["loss_scale"]
            writer.write(record)
            log(progress_line(record) + (" (skipped: non-finite gradients)" if result["skipped"] else ""))
        if cfg.straggler_interval and step % cfg.straggler_interval == 0:
            times, hosts = gather_step_times(step_time)
            log(straggler_report(times, hosts).describe())
        if cfg.eval_interval and step % cfg.eval_interval == 0:
            run_eval(step)
        if cfg.save_interval and step % cfg.save_interval == 0:
            save(step)
        if watchdog:
            watchdog.progress(step)  # a finished step (evaluation and checkpoint included)
        if preemption.should_stop(step):
            save(step)
            log(f"stopping after step {step} on a signal" + (f"; resume with --load {cfg.save}" if cfg.save else ""))
            stopped = True
            break

    if not stopped and start_step < cfg.train_iters:
        save(cfg.train_iters)
        if not (cfg.eval_interval and cfg.train_iters % cfg.eval_interval == 0):  # else just evaluated
            run_eval(cfg.train_iters)
    profiler.close()  # stopped by a signal inside the profiled window: nothing written
    if checkpointer is not None:
        checkpointer.finish()  # a background write completes before the process exits
    preemption.close()
    writer.close()
    comm.barrier(comm.world_group())
    if watchdog:
        watchdog.stop()
    destroy_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
