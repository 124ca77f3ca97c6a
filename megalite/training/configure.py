"""A run's configuration resolved for its world, or every problem with its fix before any collective.

The pure checks live in launch_checks.py (torch-free, shared with the planner); this adds what needs
the installed packages and the machine: the kernel backend, the metrics sinks, the --save disk.
"""
from __future__ import annotations

import os

import torch

from megalite.checkpoint.storage import check_save_dir
from megalite.config import RunConfig
from megalite.errors import ConfigError
from megalite.kernels.dispatch import backend_name
from megalite.plan.layout import DTYPE_BYTES
from megalite.training.launch_checks import launch_problems, machine_problems
from megalite.training.metrics_sinks import sink_problems


def configure(cfg: RunConfig, world_size: int, tokenizer_vocab_size: int | None,
              memory: tuple[float, str] | None = None) -> RunConfig:
    """The configuration resolved for this world, or ConfigError listing every problem and its fix.
    `memory`: (bytes, whose) each rank may use (`memory_per_rank()`), to refuse a layout that cannot fit."""
    if cfg.bound_problems():  # before resolving, which divides by the degrees
        raise ConfigError.listing(cfg.bound_problems())
    cfg = cfg.resolved(world_size, tokenizer_vocab_size)
    problems = launch_problems(cfg, world_size, tokenizer_vocab_size, memory)
    try:
        backend = backend_name()
    except ValueError as exc:  # MEGALITE_KERNEL_BACKEND names no backend: one line, like a flag's mistake
        problems, backend = problems + [str(exc)], "auto"
    problems += machine_problems(cfg, torch.cuda.is_available(), backend)
    problems += sink_problems(cfg.logging)  # --tensorboard-dir / --wandb-project without their package
    if not problems and cfg.checkpoint.save is not None:  # found now, not at the first checkpoint hours in
        problems += check_save_dir(cfg.checkpoint.save, _checkpoint_bytes_per_node(cfg, world_size))
    if problems:
        raise ConfigError.listing(problems)
    return cfg


def _checkpoint_bytes_per_node(cfg: RunConfig, world_size: int) -> int:
    """Weights + fp32 master, exp_avg, exp_avg_sq, for this node's ranks' share (node-local disks)."""
    per_param = DTYPE_BYTES[cfg.precision.precision] + 12
    node_share = min(1.0, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / max(1, world_size))
    return int(cfg.gpt_config().num_params() * per_param * node_share)
