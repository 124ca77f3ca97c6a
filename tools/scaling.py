"""Scaling efficiency: the same job at world sizes 1, 2, 4, ..., throughput at N / (N x throughput at 1).

    python tools/scaling.py --max-world 8 -- --model gpt2-124m --micro-batch-size 4 --train-iters 30
    python tools/scaling.py --sizes 2,4,8 --tp 2 -- --train-iters 30       # a layout: tp 2, dp grows
    python tools/scaling.py --max-world 4 --json -- --train-iters 20         # one JSON object per size

Each size runs `torchrun --standalone --nproc_per_node N examples/pretrain_gpt.py <job flags>
--tp T --pp P --cp C --dp N/(T*P*C) --metrics-file ...` on this machine (for several nodes, run
the job with your launcher at each size and feed the throughputs to `efficiency_rows`). The data
parallel degree is what grows; the micro batch per dp rank stays fixed (weak scaling: the global
batch is micro batch x dp unless the job flags fix it). Throughput is the median tokens/s over the
logged steps after the first (warm-up). Efficiency is relative to the smallest size:

    efficiency(N) = throughput(N) / ((N / N0) * throughput(N0))

and any size below 80% is flagged with the usual causes: exposed dp communication (the run prints
megalite's advice when it is above 20% of the step: fewer nodes, a larger micro batch, bf16
reduction or PowerSGD), or ranks sharing too few cores/links.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

from megalite.cli import OneLineParser
from megalite.errors import UsageError, reports_usage_errors

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 0.80
# the job's default (600 steps) is a training run, not a measurement: 20 steps unless the job flags say
# otherwise (a flag given after `--` comes later on the command line and wins)
DEFAULT_JOB = ("--train-iters", "20", "--eval-iters", "0")


def parse_sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; UsageError naming the bad entry."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--sizes {text}: world sizes are whole numbers separated by commas, e.g. 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--sizes {text}: give one or more world sizes >= 1, e.g. 1,2,4")
    return sizes


def oversubscription_note(rows: list[dict], cores: int | None) -> str | None:
    """A caveat when the largest world has more ranks than this machine has cores: the ranks then share
    cores, so the smallest size's throughput (the baseline) is itself held back and efficiencies above
    100% say more about the baseline than about scaling."""
    largest = max(row["world"] for row in rows)
    if cores is None or largest <= cores and all(row["efficiency"] <= 1.0 + 1e-9 for row in rows):
        return None
    return (f"note: {largest} ranks on {cores} CPU cores: ranks share cores (and torch threads), so these "
            f"efficiencies (any above 100% especially) reflect contention, not scaling; measure on one "
            f"device per rank")


def world_sizes(max_world: int, model_parallel: int) -> list[int]:
    """model_parallel * 1, 2, 4, ... up to max_world."""
    sizes, n = [], model_parallel
    while n <= max_world:
        sizes.append(n)
        n *= 2
    return sizes


def efficiency_rows(throughputs: dict[int, float]) -> list[dict]:
    """[{world, tokens_per_sec, efficiency, flagged}] by world size, relative to the smallest."""
    base = min(throughputs)
    rows = []
    for world in sorted(throughputs):
        efficiency = throughputs[world] / (world / base * throughputs[base])
        rows.append({"world": world, "tokens_per_sec": throughputs[world], "efficiency": efficiency,
                     "flagged": efficiency < LIMIT})
    return rows


def describe(rows: list[dict]) -> str:
    lines = [f"{'world':>6} {'tokens/s':>12} {'efficiency':>11}"]
    for row in rows:
        flag = f"  < {LIMIT:.0%}: see the run's advice (exposed dp communication) or fewer ranks per core/link" \
            if row["flagged"] else ""
        lines.append(f"{row['world']:>6} {row['tokens_per_sec']:>12.4g} {row['efficiency']:>10.0%}{flag}")
    return "\n".join(lines)


def job_command(world: int, args, job_flags: list[str], metrics: pathlib.Path) -> list[str]:
    model_parallel = args.tp * args.pp * args.cp
    # this Python's torchrun (the one megalite is installed in), not whichever `torchrun` PATH finds first
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
            str(ROOT / args.script), *DEFAULT_JOB, *job_flags,
            "--tp", str(args.tp), "--pp", str(args.pp), "--cp", str(args.cp), "--dp", str(world // model_parallel),
            "--metrics-file", str(metrics), "--log-interval", "1"]


def measured_throughput(metrics: pathlib.Path) -> float:
    """Median tokens/s of the logged steps after the first."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
    if not rates:
        raise SystemExit(f"scaling: {metrics} has fewer than 2 logged steps; give the job more --train-iters")
    return statistics.median(rates)


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--sizes", default=None, help="world sizes, e.g. 1,2,4 (default: doubling to --max-world)")
    for name in ("tp", "pp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"fixed {name} of the layout (dp grows)")
    parser.add_argument("--script", default="examples/pretrain_gpt.py", help="the job, relative to the repository")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(own)
    bad = [f"--{name} {getattr(args, name)}" for name in ("tp", "pp", "cp", "max_world") if getattr(args, name) < 1]
    if bad:
        raise UsageError(f"{', '.join(bad).replace('_', '-')}: must be >= 1")
    model_parallel = args.tp * args.pp * args.cp
    sizes = parse_sizes(args.sizes) if args.sizes else world_sizes(args.max_world, model_parallel)
    if not sizes or any(s % model_parallel for s in sizes):
        print(f"scaling: every world size must be a multiple of tp*pp*cp = {model_parallel}; got {sizes}",
              file=sys.stderr)
        return 2
    throughputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sizes:
            metrics = pathlib.Path(tmp) / f"world{world}.jsonl"
            done = subprocess.run(job_command(world, args, job_flags, metrics), cwd=ROOT)
            if done.returncode != 0:
                print(f"scaling: the job failed at world size {world} (exit {done.returncode})", file=sys.stderr)
                return done.returncode
            throughputs[world] = measured_throughput(metrics)
    rows = efficiency_rows(throughputs)
    print(json.dumps(rows, indent=1) if args.json else describe(rows))
    note = oversubscription_note(rows, os.cpu_count()) if not _has_gpus() else None
    if note:
        print(note, file=sys.stderr)
    return 0


def _has_gpus() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
