#!/usr/bin/env python3
"""The GEMMs a real training step ran, against what a hardware profile says they should take.

    python examples/pretrain_gpt.py --profile-steps 10 12 --profile-dir prof     # any run, any layout
    python tools/plan.py --calibrate this.json                                   # this machine's profile
    python tools/gemm_in_step.py prof/ops_rank00000_steps10-12.json --hardware this.json

The planner's step time is mostly GEMMs at the profile's efficiency for their size
(megalite/plan/hardware.py), and that efficiency comes from GEMMs timed alone (a calibration, or
microbenchmarks for the built-in GPUs). Inside a step the same GEMMs run with other kernels
around them, on a GPU at the clock it holds under sustained load: this tool measures how far they
keep the profile's rate. It reads the op summary --profile-steps writes beside each trace, takes
every matrix product (aten::mm, addmm, bmm, baddbmm: the leaves, so none is counted twice), and
prints, by shape: calls, measured time per call and rate, the profile's time, and their ratio;
then the totals. `measured / profile` over 1 says the step's GEMMs ran slower than the profile
predicts (the planner's step time is then optimistic by that much on its GEMM part).
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import sys
from pathlib import Path

from megalite.plan.hardware import load_profile
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def gemm_dims(name: str, input_shapes: list[list[int]]) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of one matrix-product op from its input shapes; None for any other op.
    mm: [m, k] x [k, n]; addmm: bias, [m, k], [k, n]; bmm: [b, m, k] x [b, k, n]; baddbmm: bias first."""
    if name not in GEMM_OPS:
        return None
    operands = input_shapes[1:3] if name in ("aten::addmm", "aten::baddbmm") else input_shapes[:2]
    left, right = operands
    if name in ("aten::mm", "aten::addmm"):
        (m, k), (_, n) = left, right
        return 1, m, n, k
    (batch, m, k), (_, _, n) = left, right
    return batch, m, n, k


def compare(summary: dict, profile, precision: str) -> list[dict]:
    """One row per GEMM shape: calls, flops, measured and profile seconds (totals over the window)."""
    rows = []
    for op in summary["ops"]:
        dims = gemm_dims(op["name"], op["input_shapes"])
        if dims is None or op["count"] == 0:
            continue
        batch, m, n, k = dims
        rows.append({"op": op["name"], "batch": batch, "m": m, "n": n, "k": k, "calls": op["count"],
                     "flops": 2 * batch * m * n * k * op["count"], "measured_s": op["time_us"] * 1e-6,
                     "profile_s": profile.matmul_seconds(m, n, k, precision, batch=batch) * op["count"]})
    return sorted(rows, key=lambda r: -r["measured_s"])


def report(rows: list[dict], summary: dict, profile_name: str, precision: str) -> str:
    lines = [f"GEMMs of {summary['steps']} profiled step(s) on {summary['device']} against profile "
             f"{profile_name!r} at {precision}",
             f"{'op':<14s} {'batch':>5s} {'m':>7s} {'n':>7s} {'k':>7s} {'calls':>6s} {'us/call':>10s} "
             f"{'TFLOP/s':>8s} {'profile us':>10s} {'measured/profile':>16s}"]
    for r in rows:
        per_call = r["measured_s"] / r["calls"]
        lines.append(f"{r['op']:<14s} {r['batch']:5d} {r['m']:7d} {r['n']:7d} {r['k']:7d} {r['calls']:6d} "
                     f"{per_call * 1e6:10.1f} {r['flops'] / r['calls'] / per_call / 1e12:8.3f} "
                     f"{r['profile_s'] / r['calls'] * 1e6:10.1f} {r['measured_s'] / r['profile_s']:16.2f}")
    measured, predicted = sum(r["measured_s"] for r in rows), sum(r["profile_s"] for r in rows)
    flops = sum(r["flops"] for r in rows)
    lines.append(f"total: {flops / 1e9:.3f} GFLOP in {measured * 1e3:.2f} ms measured ({flops / measured / 1e12:.3f} "
                 f"TFLOP/s), {predicted * 1e3:.2f} ms on the profile: measured / profile {measured / predicted:.3f}")
    return "\n".join(lines)


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", help="an ops_rank*_steps*.json that --profile-steps wrote")
    parser.add_argument("--hardware", default=None, help="a built-in profile name or a profile file "
                        "(default: the planner's default)")
    parser.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"),
                        help="the run's precision (default: fp32 on a CPU, bf16 on a GPU)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    path = Path(args.ops)
    if not path.is_file():
        print(f"gemm_in_step: no file {path}; run with --profile-steps A B --profile-dir DIR first", file=sys.stderr)
        return 2
    summary = json.loads(path.read_text())
    profile = load_profile(args.hardware)
    precision = args.precision or ("fp32" if summary["device"] == "cpu" else "bf16")
    rows = compare(summary, profile, precision)
    if not rows:
        print(f"gemm_in_step: {path} holds no matrix products ({', '.join(GEMM_OPS)})", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else report(rows, summary, profile.name, precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
