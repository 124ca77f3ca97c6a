#!/usr/bin/env python3
"""Pictures of the planner's answers (`tools/plan.py --plot FILE` draws them; PNG or SVG by suffix).

- one layout: the memory of one rank of every pipeline stage, stacked (parameters, gradients,
  optimizer state, activations, transient buffers: plan/buffers.py), the activations' per-layer share written on them, the GPU's memory
  (--gpu-memory) and its 90% usable line drawn across;
- --suggest: the top candidates side by side, predicted step time on the left and per-rank memory
  (stacked as above) on the right, each labelled with its layout.

The numbers are the planner's (megalite.plan): the same stage_model_states / activation_bytes that
estimate() takes its worst stage from. Needs matplotlib: pip install 'megalite[plot]'.
"""
from __future__ import annotations

from megalite.config import RunConfig
from megalite.extras import pyplot
from megalite.plan import GB
from megalite.plan.activations import activation_bytes
from megalite.plan.buffers import buffer_bytes
from megalite.plan.per_rank import stage_layers, stage_model_states

PARTS = (("parameters", "#4C72B0"), ("gradients", "#DD8452"), ("optimizer state", "#55A868"),
         ("activations", "#C44E52"), ("buffers", "#937860"))


def stage_breakdown(model, cfg: RunConfig) -> list[dict]:
    """Per pipeline stage: {parameters, gradients, optimizer state, activations, buffers} bytes of one
    rank, and the stage's layers."""
    rows = []
    for stage, layers in enumerate(stage_layers(model, cfg)):
        weights, grads, optimizer, _ = stage_model_states(model, cfg, stage)
        rows.append({"parameters": weights, "gradients": grads, "optimizer state": optimizer,
                     "activations": activation_bytes(model, cfg, stage), "buffers": buffer_bytes(model, cfg, stage),
                     "layers": layers})
    return rows


def _stacked(ax, labels: list[str], rows: list[dict], gpu_memory: float | None) -> None:
    """Horizontal stacked bars in GB, one per row."""
    left = [0.0] * len(rows)
    for part, colour in PARTS:
        sizes = [row[part] / GB for row in rows]
        ax.barh(labels, sizes, left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, sizes)]
    for i, row in enumerate(rows):
        if row.get("layers"):
            ax.text(left[i], i, f"  {row['activations'] / GB / row['layers']:.2f} GB activations per layer",
                    va="center", fontsize=7)
    if gpu_memory:
        ax.axvline(gpu_memory / GB, color="black", linewidth=1, label=f"GPU {gpu_memory / GB:.0f} GB")
        ax.axvline(0.9 * gpu_memory / GB, color="black", linestyle="--", linewidth=0.8, label="90% usable")
    ax.invert_yaxis()
    ax.set_xlabel("GB per rank (1e9 bytes)")
    ax.grid(axis="x", alpha=0.3)


def plot_layout(model, cfg: RunConfig, out: str, gpu_memory: float | None = None) -> list[str]:
    """The per-stage memory of one layout into `out`; returns the panels' titles."""
    plt = pyplot("tools/plan.py --plot")
    rows = stage_breakdown(model, cfg)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(rows)))
    _stacked(ax, [f"stage {s} ({row['layers']} layers)" for s, row in enumerate(rows)], rows, gpu_memory)
    p = cfg.parallel
    title = (f"memory per rank: tp {p.tp}, pp {p.pp}, dp {cfg.dp}" + (f", cp {p.cp}" if p.cp > 1 else "")
             + f", zero {p.zero}, recompute {p.recompute}, micro batch {cfg.training.micro_batch_size}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return [title]


def plot_candidates(found: list, out: str, gpu_memory: float | None = None) -> list[str]:
    """--suggest's candidates (megalite.plan.ranking.Suggestion: cfg, estimate, step_time_s): time and memory
    side by side, best first; returns the panels' titles."""
    plt = pyplot("tools/plan.py --plot")
    labels = []
    for s in found:
        p = s.cfg.parallel
        labels.append(f"tp{p.tp} pp{p.pp} dp{s.cfg.dp}" + (f" cp{p.cp}" if p.cp > 1 else "")
                      + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
                      + f" z{p.zero} {p.recompute} mb{s.cfg.training.micro_batch_size}")
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * len(found)), sharey=True)
    time_ax.barh(labels, [s.step_time_s for s in found], color="#8172B3")
    time_ax.invert_yaxis()
    time_ax.set_xlabel("predicted seconds per step")
    time_ax.grid(axis="x", alpha=0.3)
    rows = [{"parameters": s.estimate.param_bytes, "gradients": s.estimate.grad_bytes,
             "optimizer state": s.estimate.optimizer_state_bytes, "activations": s.estimate.activation_bytes,
             "buffers": s.estimate.buffer_bytes}
            for s in found]
    _stacked(memory_ax, labels, rows, gpu_memory)
    memory_ax.invert_yaxis()  # shared y: _stacked inverted it a second time
    titles = ["step time (best first)", "memory per rank (worst stage)"]
    time_ax.set_title(titles[0], fontsize=10)
    memory_ax.set_title(titles[1], fontsize=10)
    memory_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return titles
