"""Where the metrics go besides the JSON lines file: TensorBoard and Weights & Biases.

    sinks = open_sinks(cfg.logging, run_config=cfg.to_dict())   # rank 0 only
    for sink in sinks: sink.scalars({"loss": 2.1, "lr": 3e-4}, step=10)

Every sink receives the same fields the JSON lines file holds (every number of a step record, the
evaluation's eval_loss and eval_perplexity, an event's numbers under "<event>/"), so a curve read in
TensorBoard, in W&B or from the file is the same curve. The dashboards group them as torchtitan's do
(`tag_of`): train/ (loss, lr, grad_norm, batch...), perf/ (throughput, MFU, step time), memory/, comm/
(bytes moved), moe/ and eval/; the file keeps the flat field names. Each backend is an optional extra
(megalite.extras): `sink_problems` names a missing one at launch, on every rank, before any process
group exists (one line, exit 2), so a run never silently writes nothing.
"""
from __future__ import annotations

import netrc
import os
import urllib.parse
from typing import Any, Protocol

from megalite.extras import MissingExtraError, require


PERF_FIELDS = frozenset({"tokens_per_sec", "tokens_per_sec_per_rank", "samples_per_sec", "step_time_s",
                         "tflops_per_rank", "mfu", "hfu", "eta_s", "gpu_hours", "pipeline_bubble"})


def tag_of(field: str) -> str:
    """The dashboard tag of a metrics field: eval_loss -> eval/loss, mem_peak_bytes -> memory/peak_bytes,
    tokens_per_sec -> perf/tokens_per_sec, cp_comm_bytes -> comm/cp_comm_bytes, moe_aux_loss -> moe/aux_loss,
    anything else of a step -> train/<field>; an event's "<event>/<name>" stays as it is."""
    if "/" in field:
        return field
    for prefix, group in (("eval_", "eval"), ("mem_", "memory"), ("moe_", "moe")):
        if field.startswith(prefix):
            return f"{group}/{field[len(prefix):]}"
    if field in PERF_FIELDS:
        return f"perf/{field}"
    if field.endswith("_bytes"):
        return f"comm/{field}"
    return f"train/{field}"


class MetricsSink(Protocol):
    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars as TensorBoard events under `log_dir` (torch.utils.tensorboard's SummaryWriter)."""

    def __init__(self, log_dir: str):
        writer_class = require("torch.utils.tensorboard", "--tensorboard-dir").SummaryWriter
        self._writer = writer_class(log_dir)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(tag_of(key), value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run (project, name, directory from the flags; the resolved configuration as its
    config). WANDB_MODE=offline writes it locally for `wandb sync` later (and is how it is tested)."""

    def __init__(self, project: str, name: str | None, save_dir: str | None, run_config: dict[str, Any]):
        wandb = require("wandb", "--wandb-project")
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=save_dir, config=run_config, reinit=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        self._run.log({tag_of(key): value for key, value in values.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


def sink_problems(logging_settings) -> list[str]:
    """One line per sink a flag asks for whose package is missing, or W&B settings without a project
    (empty when all is well)."""
    wanted = [("torch.utils.tensorboard", "--tensorboard-dir", logging_settings.tensorboard_dir),
              ("wandb", "--wandb-project", logging_settings.wandb_project)]
    problems = [f"{flag} names a W&B run but no project: add --wandb-project NAME"
                for flag, value in (("--wandb-exp-name", logging_settings.wandb_exp_name),
                                    ("--wandb-save-dir", logging_settings.wandb_save_dir))
                if value and not logging_settings.wandb_project]
    for module, flag, value in wanted:
        if value:
            try:
                require(module, flag)
            except MissingExtraError as exc:
                problems.append(str(exc))
    if logging_settings.wandb_project and not problems and not wandb_can_log():
        problems.append(f"--wandb-project {logging_settings.wandb_project}: no W&B API key here (WANDB_API_KEY, or "
                        f"`wandb login`); log in, or set WANDB_MODE=offline to log locally and `wandb sync` later")
    return problems


def wandb_can_log() -> bool:
    """Whether wandb.init would find what it needs: an offline or disabled mode, an API key in the
    environment, or a login (`wandb login` writes the key into ~/.netrc for the W&B host)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_sinks(logging_settings, run_config: dict[str, Any] | None = None) -> list[MetricsSink]:
    """The sinks the logging flags ask for (call on the writing rank only)."""
    sinks: list[MetricsSink] = []
    if logging_settings.tensorboard_dir:
        sinks.append(TensorBoardSink(logging_settings.tensorboard_dir))
    if logging_settings.wandb_project:
        sinks.append(WandbSink(logging_settings.wandb_project, logging_settings.wandb_exp_name,
                               logging_settings.wandb_save_dir, run_config or {}))
    return sinks
