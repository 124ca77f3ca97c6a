"""Where a --finetune run starts: the weights of --load, or, once it has saved, its own last checkpoint.

    # every rank, before the resume plan and any process group: finetune_start, then the model from
    # the checkpoint (model_shape.py)
    cfg, notes = checkpoint_start(cfg, given_settings(argv), own_model=False)

Megatron-LM's --finetune: the model weights of --load's checkpoint (a training run's or an HF import's),
a fresh optimizer, step 0, the data from its first sample, fresh RNG streams. The command line of a
fine-tune stays the same across restarts: once --save holds a checkpoint of this run, the run resumes
from it as any run does (its optimizer, step and data position); --save equal to --load is refused, where the
two could not be told apart.
"""
from __future__ import annotations

import os

from megalite.checkpoint.elastic import find_checkpoint
from megalite.checkpoint.model_shape import adopt_checkpoint_model
from megalite.config import RunConfig
from megalite.errors import ConfigError


def finetune_start(cfg: RunConfig) -> tuple[RunConfig, list[str]]:
    """`cfg` resuming from --save when a --finetune run has already saved there (with the note saying
    so), else `cfg` as given."""
    ck = cfg.checkpoint
    if not ck.finetune or ck.load is None:
        return cfg, []
    if ck.save is not None and os.path.realpath(ck.load) == os.path.realpath(ck.save):
        raise ConfigError(f"--finetune with --save {ck.save} = --load: a restart would fine-tune its own checkpoint "
                          f"again from step 0; save into another directory (a restart then resumes from it)")
    found = find_checkpoint(ck.save) if ck.save is not None else None
    if found is None and find_checkpoint(ck.load, ck.load_step) is None:
        step = f" step {ck.load_step}" if ck.load_step is not None else ""
        raise ConfigError(f"--finetune: --load {ck.load} holds no complete checkpoint{step} to start from; point it "
                          f"at a run's --save directory or at an import (tools/convert_checkpoint.py import)")
    if found is None:
        return cfg, []
    return (cfg.replace(load=ck.save, load_step=None, finetune=False),
            [f"megalite: --finetune: {ck.save} already holds this fine-tune's step {found[0]}; resuming from it "
             f"(not from {ck.load})"])


def checkpoint_start(cfg: RunConfig, given: frozenset[str], *, own_model: bool) -> tuple[RunConfig, list[str]]:
    """`finetune_start`, then (for GPTModel; a user's own model builds its own shape) the model of the
    checkpoint --load names (model_shape.adopt_checkpoint_model); with rank 0's notes."""
    cfg, notes = finetune_start(cfg)
    if own_model:
        return cfg, notes
    cfg, shape_notes = adopt_checkpoint_model(cfg, given)
    return cfg, notes + shape_notes
