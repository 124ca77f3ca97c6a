"""What a training job runs beside the model: metrics, profiler, guards, hang watchdog, checkpoints, signals.

`open_services` builds them for one rank and registers each one's release on the job's ExitStack
(`on_exit`), so they are released in reverse order however the job ends; the loop (loop.py) and a
step as it runs (step_run.py) read them by name from the typed `Services`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megalite.distributed import comm
from megalite.checkpoint.preemption import PreemptionHandler
from megalite.checkpoint.save import Checkpointer
from megalite.cli import to_toml
from megalite.config import Precision, RunConfig
from megalite.config.model import GPTConfig
from megalite.distributed.mesh import Mesh
from megalite.plan import recompute_fraction
from megalite.training.guards import NonFiniteGuard
from megalite.training.metrics import MetricsWriter, ThroughputMeter, TimeBreakdown, peak_tflops
from megalite.training.metrics_sinks import open_sinks
from megalite.training.profiling import StepProfiler
from megalite.training.watchdog import HangWatchdog


@dataclass
class Services:
    """One rank's services of a training job (each released when the job ends)."""

    meter: ThroughputMeter  # throughput, MFU, ETA of each logged step
    writer: MetricsWriter  # the metrics file and sinks (rank 0 writes)
    timer: TimeBreakdown  # a step's time split by phase
    profiler: StepProfiler  # --profile-steps
    guard: NonFiniteGuard  # --on-nonfinite
    watchdog: HangWatchdog | None  # --hang-timeout
    checkpointer: Checkpointer | None  # --save
    preemption: PreemptionHandler  # SIGTERM/SIGUSR1/SIGINT: every rank stops after the same step


def on_exit(resources: contextlib.ExitStack, release: Callable[[bool], None]) -> None:
    """Register `release(clean)`: clean is True when the job ends without an exception."""
    resources.push(lambda exc_type, exc, tb: release(exc_type is None))


def open_services(cfg: RunConfig, model_cfg: GPTConfig, mesh: Mesh, resources: contextlib.ExitStack, *,
                  log: Callable[..., None]) -> Services:
    """The job's services for this rank, each registered on `resources`; the last registration meets
    the other ranks at a barrier on a clean end (so it runs first)."""
    lg, ft, ck = cfg.logging, cfg.fault_tolerance, cfg.checkpoint
    precision = cfg.precision.precision
    peak = lg.peak_tflops or peak_tflops(torch.cuda.get_device_name() if mesh.device.type == "cuda" else None,
                                         precision)
    meter = ThroughputMeter(model_cfg, model_cfg.seq_length, micro_batch_size=cfg.training.micro_batch_size,
                            dp=cfg.dp, num_microbatches=cfg.num_microbatches, world_size=mesh.world_size,
                            recompute=cfg.parallel.recompute, total_steps=cfg.training.train_iters,
                            peak_tflops_per_gpu=peak, recompute_fraction=recompute_fraction(model_cfg, cfg))
    sinks = open_sinks(lg, run_config=cfg.to_dict()) if mesh.rank == 0 else []  # TensorBoard, W&B
    writer = MetricsWriter(lg.metrics_file, sinks, enabled=mesh.rank == 0)
    on_exit(resources, lambda clean: writer.close())
    if mesh.rank == 0 and lg.metrics_file:  # the resolved configuration beside the metrics
        Path(lg.metrics_file).with_suffix(".config.toml").write_text(to_toml(cfg, cfg.derived()))
    profiler = StepProfiler(lg.profile_steps, lg.profile_dir, mesh.rank, mesh.device, log=log,
                            memory_snapshot=(lg.memory_snapshot, lg.memory_snapshot_step))
    on_exit(resources, lambda clean: profiler.close())  # stopped inside the profiled window: nothing written
    guard = NonFiniteGuard(mesh, ft.on_nonfinite, loss_scaling=precision == Precision.FP16, log=log,
                           max_skipped=ft.max_skipped_steps)
    watchdog = HangWatchdog(ft.hang_timeout, ft.hang_report_dir, mesh=mesh).start() if ft.hang_timeout else None
    if watchdog is not None:
        on_exit(resources, lambda clean: watchdog.stop())
    checkpointer = Checkpointer(ck.save, mesh, keep_last=ck.keep_last, keep_every=ck.keep_every,
                                async_save=ck.async_save, log=log) if ck.save else None
    if checkpointer is not None:  # the last background write lands before the process ends
        on_exit(resources, lambda clean: checkpointer.finish() if clean else checkpointer.abandon())
    preemption = PreemptionHandler(mesh, install=False)  # SIGTERM/SIGUSR1/SIGINT: all stop after the same step
    on_exit(resources, lambda clean: preemption.close())
    on_exit(resources, lambda clean: comm.barrier(comm.world_group()) if clean else None)
    return Services(meter=meter, writer=writer, timer=TimeBreakdown(), profiler=profiler, guard=guard,
                    watchdog=watchdog, checkpointer=checkpointer, preemption=preemption)
