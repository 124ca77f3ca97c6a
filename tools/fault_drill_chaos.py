"""`tools/fault_drill.py --chaos`: kill replica groups at random moments of a long run that never stops.

    python tools/fault_drill.py --chaos                       # 3 replica groups, 60 steps, 6 kills, seed 0
    python tools/fault_drill.py --chaos --seed 7 --kills 10 --groups 2 --train-iters 100

Recovery without a restart (megalite/fault_tolerance/, docs/fault_tolerance.md): the replica groups
train a tiny GPT, each its own process; the drill SIGKILLs one group at a time and restarts it, and
the run goes on: the survivors finish the step without it, the restarted group heals from a live peer
at a step boundary. The plan comes from --seed: which step, which group, and the moment — inside the
forward, before the cross-group reduction, with the all-reduce in flight, after the step's outcome
before the update (the seam ReplicaGroup calls at each), or
`random`: a SIGKILL from outside at a random delay into the step (the quorum, a heal, anywhere). With
dp-shard S = 1 per group a replica group is one rank, so "a random rank" and "a random group" are the
same victim here.

Reported: one row per kill (injected or not: a group still rejoining at its step is not there to
kill), the steps whose samples were dropped, the heals, the goodput over the run (productive step
seconds / wall seconds, the recovery's seconds named `heal`: the survivors' retried step and the state
transfer), and the verdict: whether anything was lost — every step trained, every member of every step
holding the same parameter bytes, and the losses equal to the deterministic reference that drops the
same samples (megalite/fault_tolerance/reference.py). Exit code 0 only then.
"""
from __future__ import annotations

import argparse
import enum
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megalite.cli import OneLineParser
from megalite.errors import UsageError, reports_usage_errors
from megalite.fault_tolerance.launcher import Launcher
from megalite.fault_tolerance.reference import Verdict, verify
from megalite.fault_tolerance.replica_group import FAULT_MOMENTS
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.training.goodput import GoodputLedger

from fault_drill_trainer import trainer_chaos  # noqa: E402 - tools/, on the path as fault_drill.py puts it

class ChaosTarget(enum.Enum):
    RUNTIME = "runtime"  # megalite/fault_tolerance/'s replica groups (replica_group.py), stand-in compute
    TRAINER = "trainer"  # the training program (tools/fault_drill_trainer.py)


MOMENTS = FAULT_MOMENTS + ("random",)
SPACING = 8  # steps between two kills


@dataclass(frozen=True)
class ChaosFault:
    index: int
    step: int
    group: int
    moment: str
    delay_s: float  # `random`: seconds into the step


def plan_chaos(seed: int, *, groups: int, steps: int, kills: int, step_s: float) -> list[ChaosFault]:
    """`kills` faults at steps at least SPACING apart (a restarted group, back after --restart-delay-s,
    rejoins in ~10 steps: at most two groups are out at once), victims and moments drawn from `seed`;
    every moment occurs once before any repeats."""
    rng = random.Random(seed)
    slots = list(range(2, steps - SPACING // 2, SPACING))
    if kills > len(slots):
        raise UsageError(f"--kills {kills} needs --train-iters >= {SPACING * kills + SPACING // 2} (kills are "
                         f"{SPACING} steps apart); raise --train-iters or lower --kills")
    chosen = sorted(s + rng.randrange(0, 3) for s in rng.sample(slots, kills))
    moments = [MOMENTS[i % len(MOMENTS)] for i in range(kills)]
    rng.shuffle(moments)
    return [ChaosFault(i, step, rng.randrange(groups), moment, rng.uniform(0, step_s))
            for i, (step, moment) in enumerate(zip(chosen, moments))]


class InStepFaults:
    """The seam every incarnation of one group gets: SIGKILL itself at its planned (step, moment), once
    (a marker file, since a restarted incarnation can meet the same step again)."""

    def __init__(self, faults: list[ChaosFault], marks: Path):
        self.faults, self.marks = faults, marks

    def __call__(self, step: int, moment: str) -> None:
        for f in self.faults:
            mark = self.marks / f"fired{f.index}"
            if (f.step, f.moment) == (step, moment) and not mark.exists():
                mark.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)


class RandomKills:
    """The `random` faults, from outside: when the run's records reach the step before, wait the delay
    into the fault's step and SIGKILL the victim if it is alive (on_poll of Launcher.supervise)."""

    def __init__(self, faults: list[ChaosFault], marks: Path):
        self.pending = [f for f in faults if f.moment == "random"]
        self.marks, self.armed = marks, {}

    def __call__(self, launcher: Launcher) -> None:
        done = max((r["step"] for r in launcher.records()), default=-1) if self.pending else -1
        for f in list(self.pending):
            if done >= f.step:  # the step went by without it
                self.pending.remove(f)
            elif done == f.step - 1:
                self.armed.setdefault(f.index, time.monotonic() + f.delay_s)
                if time.monotonic() >= self.armed[f.index] and launcher.alive(f.group):
                    (self.marks / f"fired{f.index}").write_text(str(time.time()))
                    launcher.kill(f.group)
                    self.pending.remove(f)


def goodput(records: list[dict]) -> GoodputLedger:
    """The run's ledger: per step its slowest member's seconds, productive but for `heal` (the seconds
    the step spent retrying without a dead group and transferring the state to a restarted one)."""
    steps: dict[int, dict] = {}
    for r in records:
        if r["step"] not in steps or r["step_s"] > steps[r["step"]]["step_s"]:
            steps[r["step"]] = r
    start = min(r["time"] - r["step_s"] for r in steps.values())
    clock = [start]
    ledger = GoodputLedger(None, write=False, clock=lambda: clock[0])
    for step, r in sorted(steps.items()):
        lost = r["retry_s"] + max(x["heal_s"] for x in records if x["step"] == step)
        ledger.add_lost("heal", lost)
        ledger.step_done(step, max(0.0, r["step_s"] - lost))
    clock[0] = max(r["time"] for r in records)
    return ledger


def report(faults: list[ChaosFault], fired: set[int], verdict: Verdict, ledger: GoodputLedger, run) -> str:
    rows = [f"{'#':>2} {'group':>5} {'moment':<14} {'step':>4} {'injected':>8}"]
    rows += [f"{f.index + 1:>2} {f.group:>5} {f.moment:<14} {f.step:>4} {'yes' if f.index in fired else 'no':>8}"
             for f in faults]
    dropped = sum(len(g) for g in verdict.dropped.values()) * run.per_group
    lost = [r for r in (ledger.lost["heal"],)]
    nothing_lost = verdict.nothing_lost and verdict.steps == run.steps
    rows += ["", f"kills injected: {len(fired)} of {len(faults)}; heals: {len(verdict.heals)} "
                 f"({', '.join(f'group {g} at step {s}' for s, g in verdict.heals) or 'none'})",
             f"steps trained: {verdict.steps} of {run.steps} (training never stopped)" if verdict.steps == run.steps
             else f"steps trained: {verdict.steps} of {run.steps}",
             f"samples dropped: {dropped} of {run.steps * run.groups * run.per_group} (steps "
             f"{sorted(verdict.dropped)}: their dead groups' samples, as the reference drops them)",
             f"goodput{ledger.describe().split('goodput', 1)[1]}; heal seconds per injected kill: "
             f"{lost[0] / max(1, len(fired)):.2f} (a group is dead after {run.dead_after_s:g} s of silence)",
             f"reference: losses {'bit for bit' if verdict.losses_bitwise else 'within %.2g' % verdict.max_loss_rel_diff}"
             f", parameters {'bit for bit' if verdict.params_bitwise else 'to rounding (three-way sums)'}; members "
             f"{'agree bit for bit' if verdict.members_agree else 'DISAGREE'}",
             f"verdict: {'NOTHING LOST' if nothing_lost else 'FAIL'}"]
    return "\n".join(rows)


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="picks steps, victims, moments and delays")
    p.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--target", type=ChaosTarget, default=ChaosTarget.RUNTIME, choices=list(ChaosTarget),
                   metavar="{runtime,trainer}", help="runtime: the replica-group runtime (default); trainer: "
                   "examples/pretrain_gpt.py's training program (tools/fault_drill_trainer.py)")
    p.add_argument("--train-iters", type=int, default=None, help="default 60 (runtime), 150 x (kills + 1) "
                   "(trainer: a restarted training program builds for ~30-100 of its tiny steps)")
    p.add_argument("--save-interval", type=int, default=0, help="trainer: each group saves every N steps to its "
                   "own directory, and a kill's moment can be a checkpoint write (0: no saves)")
    p.add_argument("--step-pause-s", type=float, default=0.15, help="stand-in compute per step (seconds)")
    p.add_argument("--ft-timeout-s", type=float, default=30.0, help="longest wait for a live but slow group")
    p.add_argument("--ft-dead-after-s", type=float, default=1.0, help="heartbeat silence that declares a group dead")
    p.add_argument("--ft-min-groups", type=int, default=1)
    p.add_argument("--restart-delay-s", type=float, default=None, help="a killed group is relaunched after this "
                   "(default 1.5 s; trainer: 0.2 s, its own build takes ~1 s more)")
    p.add_argument("--workdir", default=None, help="records and marks (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the whole drill may take")
    return p.parse_args(argv)


@reports_usage_errors
def chaos_main(argv=None) -> int:
    args = parse_args(argv)
    if args.target is ChaosTarget.TRAINER:
        args.train_iters = args.train_iters or 150 * (args.kills + 1)  # a restart's build: ~30-100 tiny steps
        args.restart_delay_s = 0.2 if args.restart_delay_s is None else args.restart_delay_s
        return trainer_chaos(args)
    args.train_iters = args.train_iters or 60
    args.restart_delay_s = 1.5 if args.restart_delay_s is None else args.restart_delay_s
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megalite-chaos-"))
    run = FaultTolerantRun(groups=args.groups, steps=args.train_iters, log_dir=str(workdir),
                           timeout_s=args.ft_timeout_s, dead_after_s=args.ft_dead_after_s, min_groups=args.ft_min_groups, step_pause_s=args.step_pause_s)
    launcher = Launcher(run, restart_delay_s=args.restart_delay_s)  # refuses a bad run in one line first
    faults = plan_chaos(args.seed, groups=args.groups, steps=args.train_iters, kills=args.kills,
                        step_s=args.step_pause_s + 0.05)
    print(f"fault drill --chaos: {args.groups} replica groups, {args.train_iters} steps, {args.kills} kills, "
          f"seed {args.seed}, in {workdir}", flush=True)
    in_step = {g: InStepFaults([f for f in faults if f.group == g and f.moment != "random"], workdir)
               for g in range(args.groups)}
    launcher.supervise(faults={g: [in_step[g]] * (args.kills + 1) for g in range(args.groups)},
                       on_poll=RandomKills(faults, workdir), timeout_s=args.timeout)
    records = launcher.records()
    verdict = verify(launcher.run, records)
    fired = {f.index for f in faults if (workdir / f"fired{f.index}").exists()}
    print(report(faults, fired, verdict, goodput(records), run))
    return 0 if verdict.nothing_lost and verdict.steps == run.steps else 1
