"""A run's configuration resolved for its world, or every problem with its fix before any collective.

The pure checks live in launch_checks.py (torch-free, shared with the planner); this adds what needs
the installed packages and the machine: the kernel backend, the metrics sinks, the --save disk.
"""
from __future__ import annotations

import os

import torch

from megalite.checkpoint.storage import check_save_dir
from megalite.config import RunConfig
from megalite.config.model import preset
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


def training_vocabulary(cfg: RunConfig, tokenizer_vocab_size: int | None, *,
                        preset_given: bool) -> tuple[int | None, str | None]:
    """(the vocabulary `configure` resolves a training run with, a line to log or None).

    --vocab-size, mock data (None) and the default preset keep today's rule: --vocab-size, else the
    tokenizer's. A preset named with --model keeps its own vocabulary: a smaller tokenizer's ids fill its
    first rows (said in one line: the model is the preset, padded up for this tokenizer); a larger
    tokenizer is refused, since its ids would index past the table."""
    if cfg.model.vocab_size is not None or tokenizer_vocab_size is None or not preset_given:
        return tokenizer_vocab_size, None
    name, own = cfg.model.model, preset(cfg.model.model).vocab_size
    if tokenizer_vocab_size > own:
        raise ConfigError(f"--model {name} has a vocabulary of {own} but the tokenizer has {tokenizer_vocab_size} ids; "
                          f"give a tokenizer of at most {own} ids, or --vocab-size {tokenizer_vocab_size} for a larger "
                          f"table than the preset's")
    if tokenizer_vocab_size == own:
        return own, None
    return own, (f"megalite: --model {name} keeps its vocabulary of {own}: the tokenizer's {tokenizer_vocab_size} ids "
                 f"use its first rows, the other {own - tokenizer_vocab_size} are never a target (give --vocab-size "
                 f"{tokenizer_vocab_size} for a table of the tokenizer's size)")
