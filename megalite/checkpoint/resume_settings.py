"""A resumed run's settings against those of the run that wrote its checkpoint.

    notes = check_resumed_settings(cfg, plan)   # after configure(), before any process group

A checkpoint holds its run's resolved configuration (metadata["train_config"]). Resuming with
other settings is often deliberate (another layout: checkpoints are layout-free) but some
changes silently break the run being continued (as Megatron-LM checks on load):
  - the data order: --seed, --data-path, --split, --tokenizer, --seq-length decide which samples
    the next steps read; refused unless --override-data-order;
  - the learning-rate schedule: --lr, --min-lr, --lr-warmup-iters, --lr-decay-style and
    --train-iters (the decay's length) decide the next steps' learning rates; refused unless
    --override-opt-param-scheduler;
  - the optimizer (--optimizer adamw | muon): the saved state is the other one's (Adam's moments,
    Muon's momentum); refused unless --override-opt-param-scheduler or --no-load-optim.
Every other difference is named in one line at start. The learning rates are compared without
the factor an elastic `--elastic-batch scale` resize applied (ElasticState.lr_factor), and the
batch and dp, which the resume plan decides and logs itself, are left to it.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from megalite.checkpoint.load import ARCHITECTURE_FIELDS
from megalite.config import RunConfig, settings
from megalite.errors import ConfigError

DATA_ORDER = ("seed", "data_path", "split", "tokenizer", "seq_length")
SCHEDULE = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "train_iters")
OPTIMIZER = ("optimizer",)  # AdamW's moments are not Muon's momentum (and Muon keeps no second moment)
# where the run reads and writes, how it resumes, and what ResumePlan decides and logs: not compared
NOT_COMPARED = ("save", "load", "load_step", "no_load_optim", "finetune", "overwrite_checkpoints", "elastic_batch",
                "elastic_lr_rule", "override_data_order", "override_opt_param_scheduler", "global_batch_size", "dp")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _flat(grouped: Any) -> dict[str, Any]:
    if not isinstance(grouped, dict):
        return {}
    return {name: _plain(value) for part in grouped.values() if isinstance(part, dict) for name, value in part.items()}


def differences(cfg: RunConfig, saved_config: dict, lr_factor: float = 1.0,
                saved_lr_factor: float = 1.0) -> dict[str, tuple[Any, Any]]:
    """{setting: (the checkpoint's value, this run's)} of every compared setting that differs.
    lr_factor / saved_lr_factor: the elastic factors in this run's and the checkpoint's --lr, --min-lr."""
    saved, now = _flat(saved_config), _flat(cfg.to_dict())
    out = {}
    for name, value in now.items():
        if name in NOT_COMPARED or name not in saved:  # a setting newer than the checkpoint: nothing to compare
            continue
        old = saved[name]
        if name in ("lr", "min_lr") and old is not None and value is not None:
            old, value = old / saved_lr_factor, value / lr_factor
            if abs(old - value) <= 1e-9 * max(abs(old), abs(value)):
                continue
        if old != value:
            out[name] = (saved[name], now[name])
    return out


def _shown(name: str, old: Any, new: Any) -> str:
    return f"{settings()[name].flag} {old} -> {new}"


def model_differences(cfg: RunConfig, saved_model: Any) -> list[str]:
    """'--hidden-size 64 -> 32' for each architecture field (load.ARCHITECTURE_FIELDS) in which the
    checkpoint's model (metadata["model_config"]) and this run's differ; [] when either is unknown."""
    if not isinstance(saved_model, dict) or "flavour" not in saved_model:  # not a GPTModel (a user's model)
        return []
    try:
        now = dataclasses.asdict(cfg.gpt_config())
    except ValueError:  # the model settings themselves are wrong: validation names that
        return []
    declared = settings()
    return [f"{declared[name].flag if name in declared else name} {_plain(saved_model[name])} -> {_plain(now[name])}"
            for name in ARCHITECTURE_FIELDS if name in saved_model and name in now
            and _plain(saved_model[name]) != _plain(now[name])]


def check_resumed_settings(cfg: RunConfig, step: int, saved_config: dict, lr_factor: float = 1.0,
                           saved_lr_factor: float = 1.0, *, saved_model: Any = None) -> list[str]:
    """Lines naming every difference (empty: none); ConfigError listing every refused change at once,
    the model's shape first (`saved_model`: the checkpoint's model_config), then the data order and the
    schedule where their override flags do not accept them."""
    diff = differences(cfg, saved_config, lr_factor, saved_lr_factor)
    model = model_differences(cfg, saved_model)
    problems = []
    if model:  # no override: the weights cannot load into another shape
        problems.append(f"resuming checkpoint step {step}: it holds another model ({', '.join(model)}); resume it "
                        f"with the model settings it was saved with, or start a new run (another --save, no --load)")
    if not diff and not problems:
        return []
    ck = cfg.checkpoint
    for names, override, what in ((DATA_ORDER, ck.override_data_order, "the order of the samples read"),
                                  (SCHEDULE, ck.override_opt_param_scheduler, "the learning-rate schedule"),
                                  (OPTIMIZER, ck.override_opt_param_scheduler or ck.no_load_optim,
                                   "the optimizer its saved state belongs to (add --no-load-optim to start "
                                   "the new one's state afresh)")):
        changed = [n for n in names if n in diff]
        if changed and not override:
            flag = "--override-data-order" if names is DATA_ORDER else "--override-opt-param-scheduler"
            back = " ".join(f"{settings()[n].flag} {diff[n][0]}" for n in changed)
            problems.append(f"resuming checkpoint step {step}: {', '.join(_shown(n, *diff[n]) for n in changed)} "
                            f"changes {what}; resume with {back} as its run had, or pass {flag} to accept it")
    if problems:
        raise ConfigError.listing(problems)
    if not diff:
        return []
    listed = ", ".join(_shown(name, *values) for name, values in diff.items())
    return [f"megalite: resuming checkpoint step {step} with settings that differ from its run: {listed}"]
