#!/usr/bin/env python3
"""Draw a verified pipeline schedule as a timeline: stages x time, one box per instruction.

    python tools/plot_schedule.py --schedule 1f1b --pp 4 --microbatches 8 --out 1f1b.png
    python tools/plot_schedule.py --schedule interleaved --pp 4 --microbatches 8 --virtual-stages 2 --out i.svg
    python tools/plot_schedule.py --schedule zb-h1 --pp 4 --microbatches 8 --print-schedule   # in the terminal

The schedule is the one the executor runs (megalite.pipeline.schedules.verified_schedule: built,
transfers placed, checked not to deadlock), replayed in time by megalite.pipeline.timeline with a
backward costing two forwards (--backward-cost) and B and W one each. Forward, backward, input-
and weight-gradient boxes are coloured apart and labelled with their microbatch (chunk too when
v > 1); sends and receives are ticks at the moment a stage posts them; idle time (the bubble) is
shaded. PNG or SVG by the --out suffix; needs matplotlib (pip install 'megalite[plot]'), except
--print-schedule.
"""
from __future__ import annotations

import argparse
import sys

from megalite.cli import OneLineParser
from megalite.errors import UsageError, report_usage_error, reports_usage_errors
from megalite.extras import pyplot
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, format_schedule)
from megalite.pipeline.schedules import SCHEDULES, check_schedule_args, chunk_placement, verified_schedule
from megalite.pipeline.timeline import Block, bubble_of, schedule_timeline, text_timeline

COLOURS = {FWD: "#4C72B0", BWD: "#DD8452", BWD_INPUT: "#C44E52", BWD_WEIGHT: "#55A868"}
NAMES = {FWD: "forward", BWD: "backward", BWD_INPUT: "input gradient (B)", BWD_WEIGHT: "weight gradient (W)"}
TICKS = {SEND_ACT: ("#222222", "send activation"), RECV_ACT: ("#8172B3", "receive activation"),
         SEND_GRAD: ("#937860", "send gradient"), RECV_GRAD: ("#DA8BC3", "receive gradient")}


def timeline_for(schedule: str, pp: int, microbatches: int, v: int, backward_cost: float) -> list[Block]:
    """The blocks of the verified schedule, a forward costing 1 and a full backward `backward_cost`
    (B and W share it equally)."""
    check_schedule_args(schedule, pp, microbatches, v)
    ops = [list(stage) for stage in verified_schedule(schedule, pp, microbatches, v)]
    cost = {FWD: 1.0, BWD: backward_cost, BWD_INPUT: backward_cost / 2, BWD_WEIGHT: backward_cost / 2}
    return schedule_timeline(ops, pp, v, [cost] * pp, placement=chunk_placement(schedule))


def draw(blocks: list[Block], pp: int, v: int, title: str, out: str) -> list[str]:
    """The timeline into `out`; returns the legend's entries (what the picture shows)."""
    plt = pyplot("tools/plot_schedule.py")
    from matplotlib.lines import Line2D  # the [plot] extra: pyplot() above has checked it is installed
    from matplotlib.patches import Patch  # (the same)

    compute = [b for b in blocks if not b.is_transfer]
    makespan = max(b.end for b in compute)
    fig, ax = plt.subplots(figsize=(max(8.0, makespan * 0.35), 0.6 * pp + 1.6))
    ax.barh(range(pp), [makespan] * pp, left=0, height=0.8, color="#dddddd", hatch="//", edgecolor="#bbbbbb",
            linewidth=0)  # the idle time shows through wherever no box covers it
    for b in compute:
        ax.barh(b.stage, b.end - b.start, left=b.start, height=0.8, color=COLOURS[b.kind], edgecolor="white")
        label = f"{b.chunk}.{b.microbatch}" if v > 1 else str(b.microbatch)
        ax.text((b.start + b.end) / 2, b.stage, label, ha="center", va="center", fontsize=7, color="white")
    for b in (b for b in blocks if b.is_transfer):
        colour, _ = TICKS[b.kind]
        y = b.stage + (0.42 if b.kind in (SEND_ACT, SEND_GRAD) else -0.42)
        ax.plot([b.start], [y], marker="v" if y > b.stage else "^", color=colour, markersize=3)
    kinds = [k for k in COLOURS if any(b.kind == k for b in compute)]
    legend = [Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds]
    legend += [Line2D([], [], marker="v" if k in (SEND_ACT, SEND_GRAD) else "^", color=c, linestyle="", label=name)
               for k, (c, name) in TICKS.items() if any(b.kind == k for b in blocks)]
    legend.append(Patch(facecolor="#dddddd", hatch="//", edgecolor="#bbbbbb", label="idle (bubble)"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=7, frameon=False)
    ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{title}: bubble {bubble_of(blocks, pp):.1%}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return [h.get_label() for h in legend]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per stage (interleaved)")
    parser.add_argument("--backward-cost", type=float, default=2.0, help="a full backward, in forwards (> 0)")
    parser.add_argument("--out", default="schedule.png", help="PNG or SVG to write (by its suffix)")
    parser.add_argument("--print-schedule", action="store_true",
                        help="print the schedule (instruction lists with transfers, then the timeline) and exit")
    args = parser.parse_args(argv)
    if not args.backward_cost > 0 or args.backward_cost == float("inf"):
        parser.error(f"--backward-cost must be a finite number > 0, got {args.backward_cost}")
    return args


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = f"{args.schedule}, pp {args.pp}, {args.microbatches} microbatches" + \
        (f", v {args.virtual_stages}" if args.virtual_stages > 1 else "")
    try:
        blocks = timeline_for(args.schedule, args.pp, args.microbatches, args.virtual_stages, args.backward_cost)
        if args.print_schedule:
            ops = [list(s) for s in verified_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)]
            print(f"{name} (>a/<a: send/receive activation, >g/<g: gradient; [..] one batch of transfers)")
            print(format_schedule(ops, compute_only=False))
            print(text_timeline(blocks, args.pp))
            return 0
        drawn = draw(blocks, args.pp, args.virtual_stages, name, args.out)
    except (ValueError, UsageError) as exc:  # a schedule the arguments cannot make; matplotlib missing
        return report_usage_error(exc if isinstance(exc, UsageError) else UsageError(str(exc)), rank=0)
    print(f"wrote {args.out}: {name}, bubble {bubble_of(blocks, args.pp):.1%} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
