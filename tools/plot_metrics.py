#!/usr/bin/env python3
"""Plot loss, throughput, MFU and memory curves from one or several metrics files (JSON lines).

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out compare.png
    python tools/plot_metrics.py runs/a/metrics.jsonl --labels "tp2 pp2" --out a.png
    python tools/plot_metrics.py runs/*.jsonl --smooth 20 --out loss.png     # trailing mean of 20 points

Each file is one curve per panel (labelled by --labels or the file's parent directory), so two
layouts of the same model can be compared. Needs matplotlib, a dependency of this tool only
(megalite itself never imports it): pip install matplotlib.
"""
from __future__ import annotations

import argparse
import os
import sys

from megalite.cli import OneLineParser
from megalite.training.metrics_file import read_records

# (record key, panel title, scale applied to the value, y label)
PANELS = [
    ("loss", "training loss", 1.0, "loss"),
    ("tokens_per_sec", "throughput", 1e-3, "k tokens / s (global)"),
    ("mfu", "model FLOPs utilisation", 100.0, "MFU %"),
    ("mem_peak_bytes", "peak memory (rank 0)", 1e-9, "GB"),
]
from megalite.errors import reports_usage_errors


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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tools/plot_metrics.py needs matplotlib (a dependency of this tool only, not of "
                         "megalite): pip install matplotlib") from None
    runs = [(label, load_metrics(path)) for label, path in zip(labels, paths)]
    panels = [p for p in PANELS if any(series(records, p[0])[0] for _, records in runs)]
    if not panels:
        raise SystemExit(f"no plottable fields ({', '.join(p[0] for p in PANELS)}) in {paths}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, title, scale, unit) in zip(axes[:, 0], panels):
        for label, records in runs:
            steps, values = series(records, key, scale)
            if steps:
                ax.plot(steps, smoothed(values, smooth), label=label, linewidth=1.2)
        ax.set_title(title + (f" (trailing mean of {smooth})" if smooth > 1 else ""), fontsize=10)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [p[0] for p in panels]


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="metrics files written by --metrics-file")
    parser.add_argument("--labels", default=None, help="comma-separated, one per file (default: parent dir)")
    parser.add_argument("--out", default="metrics.png", help="PNG to write")
    parser.add_argument("--smooth", type=int, default=1, help="plot the trailing mean of N points (noisy losses)")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else \
        [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in args.files]
    if len(labels) != len(args.files):
        parser.error(f"--labels has {len(labels)} names for {len(args.files)} files")
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    drawn = plot(args.files, labels, args.out, args.smooth)
    print(f"wrote {args.out}: {', '.join(drawn)} for {len(args.files)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
