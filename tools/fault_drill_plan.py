"""The fault drill's job, fault plan and verdict arithmetic (tools/fault_drill.py runs them).

Pure Python: no torch, no processes. What the drill launches (TINY_JOB, SHRINK_JOB and the
user's flags), which faults it injects (plan_faults: seeded kinds, moments and victims), and how
it judges the result (compare_curves: every step equals the uninterrupted run's; steps_lost:
steps logged and then redone after a restart).
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from megalite.cli import parse_args  # pure Python: no torch in the drill's own process
from megalite.training.metrics_file import read_records

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"
TINY_JOB = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0", "--hidden-dropout", "0.1",
            "--lr-warmup-iters", "2", "--zero", "1"]
# --shrink: see the module docstring (TINY_JOB's --global-batch-size becomes micro * dp of --nproc)
SHRINK_JOB = ["--model", "tiny-llama", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--hidden-dropout", "0",
              "--zero", "0"]
MOMENTS = ("during-async-write", "after-save", "random")
KINDS = ("SIGKILL", "SIGTERM")


@dataclasses.dataclass
class Fault:
    kind: str  # SIGKILL or SIGTERM
    moment: str  # one of MOMENTS
    rank: int  # the victim's global rank
    delay_fraction: float  # random moment: where in the window (0..1)
    # filled in while the drill runs
    moment_seen: str = ""
    at_s: float = 0.0
    last_logged_step: int = 0
    resumed_from: int | None = None
    recovery_s: float | None = None
    world_before: int = 0  # ranks of the attempt the fault hit, and of the one that resumed
    world_after: int = 0


def plan_faults(count: int, world_size: int, seed: int) -> list[Fault]:
    """`count` faults from `seed`: kinds alternate, the special moments come first, then shuffled."""
    rng = random.Random(seed)
    kinds = [KINDS[i % 2] for i in range(count)]
    moments = [MOMENTS[i] if i < 2 else "random" for i in range(count)]
    rng.shuffle(kinds)
    rng.shuffle(moments)
    return [Fault(kind, moment, rng.randrange(world_size), rng.random()) for kind, moment in zip(kinds, moments)]


def read_losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_records(path) if "loss" in r]


def compare_curves(reference: dict[int, float], logged: list[tuple[int, float]], train_iters: int,
                   rtol: float = 0.0) -> str | None:
    """None when every step 1..train_iters was logged and every record equals the reference
    (exactly, or within `rtol` relative); else what differs."""
    missing = sorted(set(range(1, train_iters + 1)) - {step for step, _ in logged})
    if missing:
        return f"steps {missing[:8]} were never logged"
    for step, loss in logged:
        expected = reference.get(step)
        if expected is None or abs(loss - expected) > rtol * abs(expected):
            return f"step {step}: loss {loss!r}, the uninterrupted run's {expected!r}" + (f" (rtol {rtol:g})" if rtol
                                                                                            else "")
    return None


def largest_difference(reference: dict[int, float], logged: list[tuple[int, float]]) -> tuple[float, int]:
    """(largest relative loss difference from the reference, its step); (0.0, 0) when all are equal."""
    return max(((abs(loss - reference[step]) / abs(reference[step]), step) for step, loss in logged
                if step in reference and reference[step]), default=(0.0, 0))


def read_resizes(path: Path) -> list[dict]:
    """The job's world-size change records (megalite.checkpoint.elastic.Resize.record)."""
    return [r for r in read_records(path) if r.get("event") == "resize"]


def job_flags(args) -> list[str]:
    """examples/pretrain_gpt.py's flags of the drilled job (the reference's and the drill's)."""
    if not args.shrink:
        return [*TINY_JOB, *args.job_args]
    at = TINY_JOB.index("--global-batch-size")
    flags = [*TINY_JOB[:at], *TINY_JOB[at + 2:], *SHRINK_JOB]
    cfg, _ = parse_args(flags + args.job_args)
    dp = max(1, args.nproc // cfg.replace(dp=1).world_size)  # one microbatch per rank on the first world
    return [*flags, "--global-batch-size", str(cfg.training.micro_batch_size * dp), *args.job_args]


def shrink_worlds(args) -> list[int]:
    """The worlds the job can run on under --elastic-batch keep, from --nproc down: a multiple of
    one replica's ranks (tp*pp) whose dp divides the first world's global batch into microbatches."""
    cfg, _ = parse_args(job_flags(args))
    if cfg.checkpoint.elastic_batch != "keep":
        raise SystemExit("fault drill: --shrink compares with the uninterrupted run, so it needs --elastic-batch keep")
    per_replica = cfg.replace(dp=1).world_size
    first = cfg.resolved(args.nproc)
    batch, micro = first.global_batch_size, first.training.micro_batch_size
    return [w for w in range(args.nproc, 0, -1) if w % per_replica == 0 and batch % (micro * (w // per_replica)) == 0]


def steps_lost(logged: list[tuple[int, float]]) -> int:
    """Steps logged, then redone after a restart (each restart resumes at its last checkpoint)."""
    lost, last = 0, 0
    for step, _ in logged:
        if step <= last:
            lost += last - step + 1
        last = step
    return lost
