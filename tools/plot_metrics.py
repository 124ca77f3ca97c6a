#!/usr/bin/env python3
"""Plot the curves of one or several metrics files (JSON lines), several runs overlaid.

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out compare.png
    python tools/plot_metrics.py runs/a/metrics.jsonl --labels "tp2 pp2" --out a.svg
    python tools/plot_metrics.py runs/*.jsonl --smooth 20 --out loss.png     # trailing mean of 20 points

Panels (each drawn when some file has its field): training and validation loss, learning rate,
gradient norm, throughput, MFU, peak memory, and the time split of a step (compute = forward +
backward + optimizer, exposed data-parallel communication, pipeline bubble; as shares of the step).
Each file is one curve per panel (labelled by --labels or the file's parent directory), so two
layouts of the same model can be compared. PNG or SVG by the --out suffix. Needs matplotlib: pip
install 'megalite[plot]'.
"""
from __future__ import annotations

import argparse
import os
import sys

from megalite.cli import OneLineParser
from megalite.errors import UsageError, report_usage_error
from megalite.extras import pyplot
from megalite.training.metrics_file import read_records

# (record key, panel title, scale applied to the value, y label)
PANELS = [
    ("loss", "training loss", 1.0, "loss"),
    ("eval_loss", "validation loss", 1.0, "loss"),
    ("lr", "learning rate", 1.0, "lr"),
    ("grad_norm", "gradient norm (before clipping)", 1.0, "norm"),
    ("tokens_per_sec", "throughput", 1e-3, "k tokens / s (global)"),
    ("mfu", "model FLOPs utilisation", 100.0, "MFU %"),
    ("mem_peak_bytes", "peak memory (rank 0)", 1e-9, "GB"),
]
from megalite.errors import reports_usage_errors


# the time split panel: (label, the fields whose sum, divided by step_time_s, is the share; line style)
TIME_SPLIT = [("compute", ("time_forward_s", "time_backward_s", "time_optimizer_s"), "-"),
              ("exposed dp comm", ("exposed_dp_comm_s",), "--"),
              ("pipeline bubble", ("pipeline_bubble",), ":")]


def time_split(records: list[dict], fields: tuple[str, ...]) -> tuple[list[int], list[float]]:
    """(steps, % of the step) of the summed fields; pipeline_bubble is a share already."""
    by_step = {}
    for r in records:
        if "step" in r and r.get("step_time_s") and all(f in r for f in fields):
            share = sum(r[f] for f in fields) / (1.0 if fields == ("pipeline_bubble",) else r["step_time_s"])
            by_step[r["step"]] = 100.0 * share
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def load_metrics(path: str) -> list[dict]:
    """The records of a metrics file, in file order; a torn last line (a run still writing) is skipped."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return read_records(path)


def series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the records that have it (a resumed run's repeats: last wins)."""
    by_step = {r["step"]: r[key] * scale for r in records if "step" in r and r.get(key) is not None}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` points (fewer at the start); window 1: unchanged."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot(paths: list[str], labels: list[str], out: str, smooth: int = 1) -> list[str]:
    """Draw every panel some file has data for into `out`; returns the panels drawn."""
    plt = pyplot("tools/plot_metrics.py")
    runs = [(label, load_metrics(path)) for label, path in zip(labels, paths)]
    panels = [p for p in PANELS if any(series(records, p[0])[0] for _, records in runs)]
    split = any(time_split(records, fields)[0] for _, records in runs for _, fields, _ in TIME_SPLIT)
    if not panels:
        raise UsageError(f"no plottable fields ({', '.join(p[0] for p in PANELS)}) in {paths}")
    rows = len(panels) + split
    fig, axes = plt.subplots(rows, 1, figsize=(8, 2.4 * rows), sharex=True, squeeze=False)
    if split:
        _draw_time_split(axes[-1, 0], runs)
    for ax, (key, title, scale, unit) in zip(axes[:, 0], panels):
        for label, records in runs:
            steps, values = series(records, key, scale)
            if steps:
                # a marker where a curve is a point or two (one validation at the end): a line alone is invisible
                ax.plot(steps, smoothed(values, smooth), label=label, linewidth=1.2,
                        marker="o" if len(steps) < 3 else None)
        ax.set_title(title + (f" (trailing mean of {smooth})" if smooth > 1 else ""), fontsize=10)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [p[0] for p in panels] + (["time_split"] if split else [])


def _draw_time_split(ax, runs: list[tuple[str, list[dict]]]) -> None:
    """Each run's compute / exposed communication / bubble shares of the step (one colour per run)."""
    for i, (label, records) in enumerate(runs):
        for part, fields, style in TIME_SPLIT:
            steps, shares = time_split(records, fields)
            if steps:
                ax.plot(steps, shares, style, color=f"C{i}", linewidth=1.2, label=f"{label}: {part}")
    ax.set_title("time split of a step (compute -, exposed dp comm --, pipeline bubble :)", fontsize=10)
    ax.set_ylabel("% of the step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="metrics files written by --metrics-file")
    parser.add_argument("--labels", default=None, help="comma-separated, one per file (default: parent dir)")
    parser.add_argument("--out", default="metrics.png", help="PNG or SVG to write (by its suffix)")
    parser.add_argument("--smooth", type=int, default=1, help="plot the trailing mean of N points (noisy losses)")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else \
        [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in args.files]
    if len(labels) != len(args.files):
        parser.error(f"--labels has {len(labels)} names for {len(args.files)} files")
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    try:
        drawn = plot(args.files, labels, args.out, args.smooth)
    except UsageError as exc:  # matplotlib missing, no plottable field
        return report_usage_error(exc, rank=0)
    except (FileNotFoundError, ValueError) as exc:  # a missing or malformed metrics file
        return report_usage_error(UsageError(f"cannot read {exc}"), rank=0)
    print(f"wrote {args.out}: {', '.join(drawn)} for {len(args.files)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
