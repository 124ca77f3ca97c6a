"""`tools/fault_drill.py --chaos --target trainer`: kill replica groups of the real training program at random
moments of a run that never stops.

    python tools/fault_drill.py --chaos --target trainer                  # 2 groups, 3 kills, seed 0
    python tools/fault_drill.py --chaos --target trainer --seed 3 --kills 5 --save-interval 25

Each replica group is examples/pretrain_gpt.py's training program (`megalite.training.loop.main`, a tiny GPT on
mock data) with --ft-replica-groups, forked by the launcher through `trainer_groups.TrainerGroups`. The plan
comes from --seed: for each kill its victim, its moment and how many steps after it is armed the victim dies.
The moments, seams installed in the forked rank only (`TrainerSeams`): `forward` (torch's global module
forward pre-hook), `backward` (a hook on the first module output's gradient), `reduction` (the across-replicas
all-reduce just issued on the link, in flight), `optimizer` (torch's global optimizer step pre-hook: after the
step's outcome, so the survivors keep that step's samples) and, with --save-interval, `checkpoint` (the shard
written, its done marker not: checkpoint/save.py's write hold; the drill SIGKILLs the held group). Every
group saves to its own directory (trainer_groups.py says why).

A kill is armed only once the previous victim has healed (a restarted training program takes seconds to build,
hundreds of tiny steps: a fixed step would race it), so --train-iters must outlast the kills' restarts; a kill
the run ended before is reported as not injected and fails the verdict.

The verdict: every step trained (a record from every member), the groups' losses equal bit for bit at every
step, every heal done, and every step's loss equal to `trainer_reference.py` (one process, the same members'
samples) within 1e-5 relative: not bit for bit, because the run sums each group's gradient (its own mean
times its target tokens) in float64 over the link and divides once, while the reference accumulates every
member's microbatches into one fp32 buffer: the same sum, rounded differently (measured ~1e-7).
"""
from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megalite.errors import UsageError
from megalite.fault_tolerance.launcher import Launcher
from megalite.replicas.replica_link import ReplicaLink
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.fault_tolerance.trainer_groups import TrainerGroups
from megalite.fault_tolerance.trainer_reference import members_by_step, reference_losses
from megalite.replicas.trainer import ReplicaTraining
from megalite.training import loop  # noqa: F401 - imported once here: every forked group starts warm
from megalite.training.goodput import GoodputLedger

# At the default lr (2e-3) this tiny GPT fitting random tokens amplifies a one-ulp difference ~10x every few
# steps once a group trains alone (4 samples a step): two references on the same members' samples that differ
# only in the order their microbatches are accumulated in fp32 diverged 1.3e-3 within 50 such steps. At 2e-4
# the same two stay within 1.7e-7 over 900 steps, so the comparison tests the recovery, not the chaos.
STABLE_LR = 2e-4
MODEL = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
         "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1",
         "--lr-warmup-iters", "3", "--lr", str(STABLE_LR)]  # the lr: see STABLE_LR
MOMENTS = ("forward", "backward", "reduction", "optimizer")
RTOL = 1e-5  # the project's parity tolerance (tests/fault_tolerance/test_trainer_recovery.py)


@dataclass(frozen=True)
class TrainerKill:
    index: int
    group: int
    moment: str
    after: int  # steps after the kill is armed


def plan_trainer_chaos(seed: int, *, groups: int, kills: int, checkpoints: bool) -> list[TrainerKill]:
    """`kills` kills, victims, moments (each once before any repeats) and delays drawn from `seed`."""
    rng = random.Random(seed)
    moments = MOMENTS + (("checkpoint",) if checkpoints else ())
    order = list(moments)
    rng.shuffle(order)  # (then cycled: a short drill draws any of them)
    drawn = [order[i % len(order)] for i in range(kills)]
    return [TrainerKill(i, rng.randrange(groups), m, rng.randint(1, 4)) for i, m in enumerate(drawn)]


class TrainerSeams:
    """The kill seams of one group's every incarnation (installed in its forked rank, module docstring). An
    armed kill (`arm<i>.json` in the work directory, this group's) becomes pending at the first step past its
    step; at its moment the rank marks it fired and SIGKILLs itself."""

    def __init__(self, workdir: Path):
        self.workdir, self.group, self.pending = workdir, None, None

    def hold(self, group: int) -> Path:
        return self.workdir / f"hold{group}"

    def install(self, group: int) -> None:
        self.group, seams = group, self
        self.hold(group).mkdir(exist_ok=True)
        os.environ["MEGALITE_CHECKPOINT_WRITE_HOLD"] = str(self.hold(group))
        begin, reduce = ReplicaTraining.begin_step, ReplicaLink.all_reduce

        def begin_step(replicas, step):
            begin(replicas, step)
            seams.at_step(step)

        def all_reduce(link, tensor, async_op=False):
            work = reduce(link, tensor, async_op=async_op)
            seams.at("reduction")  # issued: in flight on the other members
            return work
        ReplicaTraining.begin_step, ReplicaLink.all_reduce = begin_step, all_reduce  # this forked rank's only
        register_module_forward_pre_hook(lambda module, args: self.at("forward"))
        register_module_forward_hook(self._backward_seam)
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: self.at("optimizer"))

    def at_step(self, step: int) -> None:
        if self.pending is not None:
            return
        for path in sorted(self.workdir.glob("arm*.json")):
            kill = json.loads(path.read_text())
            if kill["group"] == self.group and step > kill["step"] and not self.fired(kill["index"]).exists():
                self.pending = kill
                if kill["moment"] == "checkpoint":  # the next save holds in its write window; the drill kills
                    (self.hold(self.group) / "arm").touch()
                return

    def fired(self, index: int) -> Path:
        return self.workdir / f"fired{index}"

    def at(self, moment: str) -> None:
        if self.pending is not None and self.pending["moment"] == moment:
            self.fired(self.pending["index"]).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def _backward_seam(self, module, args, output) -> None:
        if self.pending is not None and self.pending["moment"] == "backward" and isinstance(output, torch.Tensor) \
                and output.requires_grad:
            output.register_hook(lambda grad: self.at("backward"))


class Arming:
    """The drill's side (the launcher's on_poll): arm kill i once every group is a live member and kill i - 1's
    victim healed; SIGKILL a group held in a checkpoint write for a `checkpoint` kill."""

    def __init__(self, plan: list[TrainerKill], seams: TrainerSeams, groups: TrainerGroups, count: int):
        self.plan, self.seams, self.groups, self.count = plan, seams, groups, count
        self.next, self.polled = 0, 0.0

    def __call__(self, launcher: Launcher) -> None:
        for g in range(self.count):
            if any(self.seams.hold(g).glob("held_r*")):
                kill = next(k for k in self.plan if k.group == g and k.moment == "checkpoint"
                            and (self.seams.workdir / f"arm{k.index}.json").exists()
                            and not self.seams.fired(k.index).exists())
                self.seams.fired(kill.index).write_text(str(time.time()))
                launcher.kill(g)
                for path in self.seams.hold(g).iterdir():
                    path.unlink()
        if self.next >= len(self.plan) or time.monotonic() < self.polled + 0.5:
            return
        self.polled = time.monotonic()
        if self.next and not self.seams.fired(self.next - 1).exists():
            return
        records = self.groups.records()
        everyone = [r for r in records if r["ft_members"] == list(range(self.count))]
        healed = sum(1 for r in records if r["ft_healed"])
        if healed < self.next or not everyone or not all(launcher.alive(g) for g in range(self.count)):
            return
        kill = self.plan[self.next]
        step = max(r["step"] for r in records) + kill.after
        (self.seams.workdir / f"arm{kill.index}.json").write_text(json.dumps(
            {"index": kill.index, "group": kill.group, "moment": kill.moment, "step": step}))
        self.next += 1


def goodput(records: list[dict]) -> GoodputLedger:
    """Per step its slowest member's seconds (quorum wait, heal and the timed step); productive: the step
    less its retry; the recovery's seconds (`heal`): the retry, the heal, and the quorum's wait on a step whose
    members changed (a dead group's silence)."""
    steps: dict[int, list[dict]] = {}
    for r in records:
        steps.setdefault(r["step"], []).append(r)
    clock = [0.0]
    ledger = GoodputLedger(None, write=False, clock=lambda: clock[0])
    previous = None
    for step, rs in sorted(steps.items()):
        slowest = max(rs, key=lambda r: r["ft_quorum_s"] + r["ft_heal_s"] + r["step_time_s"])
        changed = previous is not None and slowest["ft_members"] != previous
        lost = slowest["ft_retry_s"] + slowest["ft_heal_s"] + (slowest["ft_quorum_s"] if changed else 0.0)
        clock[0] += slowest["ft_quorum_s"] + slowest["ft_heal_s"] + slowest["step_time_s"]
        ledger.add_lost("heal", lost)
        ledger.step_done(step, max(0.0, slowest["step_time_s"] - slowest["ft_retry_s"]))
        previous = slowest["ft_members"]
    return ledger


@dataclass
class TrainerVerdict:
    steps: int
    dropped: dict[int, list[int]]  # step -> the groups whose samples it did not use
    heals: list[tuple[int, int]]  # (step, group)
    groups_agree: bool
    max_rel_diff: float
    problem: str | None  # why the run did not train every step with agreeing members

    @property
    def nothing_lost(self) -> bool:
        return self.problem is None and self.groups_agree and self.max_rel_diff <= RTOL


def verify(argv: list[str], groups: int, records: list[dict], train_iters: int) -> TrainerVerdict:
    """Every step's members (members_by_step), the groups' losses per step, the reference's losses."""
    try:
        members = members_by_step(records)
        problem = None if max(members, default=0) == train_iters else f"{max(members, default=0)} steps trained"
    except AssertionError as missing:
        return TrainerVerdict(0, {}, [], False, float("inf"), str(missing))
    losses: dict[int, set[float]] = {}
    for r in records:
        losses.setdefault(r["step"], set()).add(r["loss"])
    reference = reference_losses(argv, groups, members)
    worst = max(abs(min(losses[s]) - reference[s]) / abs(reference[s]) for s in reference) if reference else float("inf")
    return TrainerVerdict(len(members), {s: [g for g in range(groups) if g not in m] for s, m in members.items()
                                         if len(m) < groups},
                          sorted((r["step"], r["ft_group"]) for r in records if r["ft_healed"]),
                          all(len(v) == 1 for v in losses.values()), worst, problem)


def _spans(steps: list[int]) -> str:
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else str(s))
            start = None
    return ", ".join(out)


def report(plan: list[TrainerKill], fired: set[int], verdict: TrainerVerdict, ledger: GoodputLedger, *,
           groups: int, train_iters: int, dead_after_s: float) -> str:
    rows = [f"{'#':>2} {'group':>5} {'moment':<11} {'injected':>8}"]
    rows += [f"{k.index + 1:>2} {k.group:>5} {k.moment:<11} {'yes' if k.index in fired else 'no':>8}" for k in plan]
    samples = sum(len(g) for g in verdict.dropped.values())
    heals = len(verdict.heals)
    ok = verdict.nothing_lost and len(fired) == len(plan) and heals == len(fired)
    rows += ["", f"kills injected: {len(fired)} of {len(plan)}; heals: {heals} "
                 f"({', '.join(f'group {g} at step {s}' for s, g in verdict.heals) or 'none'})",
             f"steps trained: {verdict.steps} of {train_iters}"
             + (" (training never stopped)" if verdict.problem is None else f" ({verdict.problem})"),
             f"group-steps dropped: {samples} of {train_iters * groups} (steps {_spans(sorted(verdict.dropped))}: "
             f"a dead or rejoining group's samples, as the reference drops them)",
             f"goodput{ledger.describe().split('goodput', 1)[1]}; heal seconds per kill: "
             f"{ledger.lost['heal'] / max(1, len(fired)):.2f} (a group is dead after {dead_after_s:g} s of silence)",
             f"reference (trainer_reference.py): losses within {verdict.max_rel_diff:.2g} relative (tolerance "
             f"{RTOL:g}: float64 sums over the link); groups {'agree bit for bit' if verdict.groups_agree else 'DISAGREE'}",
             f"verdict: {'NOTHING LOST' if ok else 'FAIL'}"]
    return "\n".join(rows)


def trainer_chaos(args) -> int:
    """The drill (module docstring); 0 only when nothing was lost and every kill was injected and healed."""
    if args.groups < 2:
        raise UsageError(f"--groups {args.groups}: the trainer drill needs 2 or more replica groups (one heals "
                         f"the other); give --groups 2")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megalite-chaos-trainer-"))
    workdir.mkdir(parents=True, exist_ok=True)
    argv = MODEL + ["--train-iters", str(args.train_iters)]  # the reference's too (it does not save)
    run = FaultTolerantRun(groups=args.groups, steps=args.train_iters, log_dir=str(workdir), timeout_s=args.ft_timeout_s,
                           dead_after_s=args.ft_dead_after_s, min_groups=args.ft_min_groups,
                           join_timeout_s=max(60.0, args.ft_timeout_s))
    saves = ["--save-interval", str(args.save_interval)] if args.save_interval else []
    groups = TrainerGroups(argv + saves, workdir, save_root=workdir / "ckpt" if args.save_interval else None)
    launcher = Launcher(run, restart_delay_s=args.restart_delay_s, target=groups)
    plan = plan_trainer_chaos(args.seed, groups=args.groups, kills=args.kills, checkpoints=bool(args.save_interval))
    print(f"fault drill --chaos --target trainer: {args.groups} replica groups of the training program, "
          f"{args.train_iters} steps, {args.kills} kills, seed {args.seed}, in {workdir}", flush=True)
    seams = TrainerSeams(workdir)
    started = time.monotonic()
    exits = launcher.supervise(faults={g: [seams] * (args.kills + 1) for g in range(args.groups)},
                       on_poll=Arming(plan, seams, groups, args.groups), timeout_s=args.timeout)
    wall = time.monotonic() - started
    records = groups.records()
    verdict = verify(argv, args.groups, records, args.train_iters)
    if any(exits.values()) and verdict.problem is None:
        verdict.problem = f"groups' last exit codes {exits}"
    fired = {k.index for k in plan if seams.fired(k.index).exists()}
    print(report(plan, fired, verdict, goodput(records), groups=args.groups, train_iters=args.train_iters,
                 dead_after_s=args.ft_dead_after_s) + f"\n(drill wall time {wall:.1f} s)")
    return 0 if verdict.nothing_lost and len(fired) == len(plan) == len(verdict.heals) else 1
