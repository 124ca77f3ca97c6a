"""GOAL lines of the GPU plan's steps: each step's figure beside its goal, from the step's own output.

    python tools/gpu_goals.py STEP OUT_DIR [--mfu 0.5]    # what tools/gpu_plan.sh runs after each step

One line per goal, `GOAL <step> <what>: <goal> | measured <figure> | met / NOT met / -` (`-`: the
step reports a figure without a pass mark, e.g. a profile). Read from OUT_DIR/STEP.txt:
- lines the tools print themselves as `GOAL ...` (bench_train, bench_attention, profile_step), as is;
- kernel_tests: pytest's summary line (goal: every kernel test passes on the GPU);
- bench_kernels, bench_moe_kernels: bench_kernels.py's goals summary ("name value goal >= x verdict");
- step_time: bench_step_time.py --measure's rows ("ratio r (goal: within 15%)");
and, for a training step (examples/pretrain_gpt.py), from OUT_DIR/STEP.jsonl, its metrics file: the
median step time, tokens/s, MFU and peak memory over the steps after the 5th (the log's MFU, counted
as the planner counts it: active parameters for experts), against --mfu when given.
The tuning steps and host_overhead have no goal: a clean end (exit 0 in OUT_DIR/plan.txt) prints
`GOAL <step>: none (...) | measured ... | -`. A step whose output holds no figure prints one
`GOAL <step>: ... | measured nothing | NOT measured` line, and one that printed figures but did not end
cleanly adds `GOAL <step>: ends cleanly | measured exit N | NOT met`: a failed or timed-out step is
never silent. Pure text processing: no torch, no GPU.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import re
import statistics
import sys
from pathlib import Path

from megalite.cli import OneLineParser
from megalite.errors import reports_usage_errors

LLMC_GPT2_TOKENS_PER_S = 460e3  # llm.c's published GPT-2 124M training speed on one H100 (issue 36)


def kernel_test_goals(step: str, text: str) -> list[str]:
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text)}
    if not counts:
        return []
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    figure = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return [f"GOAL {step}: every kernel test passes on the GPU | measured {figure} | {'met' if not bad else 'NOT met'}"]


def bench_kernels_goals(step: str, text: str) -> list[str]:
    lines = []
    for name, value, target, verdict, where in re.findall(
            r"^\s+(.+?)\s+([\d.]+|-)\s+goal >= ([\d.]+)\s+(met|NOT met|not measured)(.*)$", text, re.M):
        if step.startswith("bench_moe_kernels") and "grouped_mm" not in name:
            continue  # that step runs the MoE ops only: the other goals are bench_kernels'
        where = f" {where.strip()}" if where.strip() else ""
        lines.append(f"GOAL {step} {name}: >= {target} | measured {value}{where} | {verdict}")
    return lines


def step_time_goals(step: str, text: str) -> list[str]:
    lines = []
    for name, measured, predicted, ratio in re.findall(
            r"^\s+(.+?)\s+measured\s+([\d.]+) ms\s+predicted\s+([\d.]+) ms\s+ratio ([\d.]+)\s+\(goal: within 15%\)",
            text, re.M):
        met = abs(float(ratio) - 1) <= 0.15
        lines.append(f"GOAL {step} {name}: planner within 15% of the measured step | measured {measured} ms, "
                     f"planner {predicted} ms, ratio {ratio} | {'met' if met else 'NOT met'}")
    return lines


def training_goals(step: str, metrics: Path, mfu_goal: float | None) -> list[str]:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step_time_s" in r]
    steps = [r for r in steps if r["step"] > 5] or steps
    if not steps:
        return []
    ms = statistics.median(r["step_time_s"] for r in steps) * 1e3
    tokens = statistics.median(r["tokens_per_sec"] for r in steps)
    peak = max(r.get("mem_peak_bytes", 0) for r in steps) / 1e9
    mfu = [r["mfu"] for r in steps if "mfu" in r]
    figure = f"{ms:.1f} ms/step, {tokens / 1e3:.1f}k tok/s, peak {peak:.1f} GB"
    if mfu:
        figure = f"MFU {statistics.median(mfu):.1%}, " + figure
    if "gpt2" in step:
        figure += f", {tokens / LLMC_GPT2_TOKENS_PER_S:.2f}x llm.c's ~460k tok/s (H100)"
    if mfu_goal is None:
        return [f"GOAL {step}: none (figure reported) | measured {figure} | -"]
    verdict = "not measured (no MFU: unknown GPU peak)" if not mfu else (
        "met" if statistics.median(mfu) >= mfu_goal else "NOT met")
    return [f"GOAL {step}: MFU >= {mfu_goal:.0%} | measured {figure} | {verdict}"]


# Steps that measure no goal of their own: what they produce, reported when they end cleanly
INFORMATIONAL = {"tune_attention": "tiles and the SDPA dispatch table for kernels/attention_*.py",
                 "tune_norms": "launch configs for kernels/{rms_norm,layer_norm,rope}.py",
                 "host_overhead": "issue 26's per-step counts, megalite against transformers"}


def exit_code(step: str, out_dir: Path) -> int | None:
    """The step's exit status as tools/gpu_plan.sh logged it in plan.txt (its last run), None if absent."""
    plan = out_dir / "plan.txt"
    codes = re.findall(rf"^{re.escape(step)}: exit (\d+) ", plan.read_text(), re.M) if plan.exists() else []
    return int(codes[-1]) if codes else None


def informational_goal(step: str, text: str) -> list[str]:
    summary = [line.strip() for line in text.splitlines() if line.startswith("host CPU ms per step")]
    figure = f"{summary[-1]} (megalite, transformers, ratio)" if summary else f"see {step}.txt"
    return [f"GOAL {step}: none ({INFORMATIONAL[step]}) | measured {' '.join(figure.split())} | -"]


def goals(step: str, out_dir: Path, mfu_goal: float | None = None) -> list[str]:
    text_path, metrics = out_dir / f"{step}.txt", out_dir / f"{step}.jsonl"
    text = text_path.read_text(errors="replace") if text_path.exists() else ""
    code = exit_code(step, out_dir)
    lines = [line.strip() for line in text.splitlines() if line.startswith("GOAL ")]
    if step in INFORMATIONAL and code == 0:
        lines += informational_goal(step, text)
    if step.startswith("kernel_tests"):
        lines += kernel_test_goals(step, text)
    if step.startswith("bench_kernels") or step.startswith("bench_moe_kernels"):
        lines += bench_kernels_goals(step, text)
    if step.startswith("step_time"):
        lines += step_time_goals(step, text)
    if metrics.exists():
        lines += training_goals(step, metrics, mfu_goal)
    if lines and code not in (0, None):  # figures of a step that did not end cleanly: say so beside them
        lines.append(f"GOAL {step}: ends cleanly | measured exit {code}{' (its time limit)' if code == 124 else ''} "
                     f"| NOT met")
    return lines or [f"GOAL {step}: see {text_path.name} | measured nothing (the step failed, timed out or printed "
                     f"no figure) | NOT measured"]


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--mfu", type=float, default=None, help="MFU goal of a training step (0.5 = 50%%)")
    args = parser.parse_args(argv)
    print("\n".join(goals(args.step, args.out_dir, args.mfu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
