"""Fault drill: kill workers of a real torchrun job N times and check that nothing was lost.

    python tools/fault_drill.py                                  # 3 faults, 2 ranks, a tiny GPT, seed 0
    python tools/fault_drill.py --faults 6 --nproc 4 --seed 7 -- --tp 2 --zero 1
    python tools/fault_drill.py --master-port 29700              # torchrun's static rendezvous instead
    python tools/fault_drill.py --shrink --faults 1              # every fault loses ranks for good (2 -> 1)
    python tools/fault_drill.py --chaos --seed 7                 # no restart: replica groups killed, healed in place
    python tools/fault_drill.py --chaos --target trainer         # the same, the groups the real training program

What it does:
1. runs the job uninterrupted (examples/pretrain_gpt.py under torchrun, --save/--load,
   --async-save, --log-interval 1, --metrics-file): the reference loss curve;
2. runs the same job under `torchrun --max-restarts K` and, N times, signals one worker: SIGKILL
   (torchrun restarts the group) or SIGTERM (every rank saves after the current step and exits
   0, as under a scheduler's preemption; the drill then relaunches the same command, as the
   scheduler would). Moments: `random` (a seeded delay into the running attempt),
   `during-async-write` (a shard written into `step_N.tmp/`, its done marker not yet: the drill
   arms a hold file, MEGALITE_CHECKPOINT_WRITE_HOLD, that the writers wait on inside that window
   until the signal is sent, so the moment is hit on a file, not on timing; --write-delay still
   simulates a slow file system) and
   `after-save` (as soon as `latest` changes). Kinds, moments, victims and delays come from
   --seed; with N >= 2 both kinds and, with N >= 3, all three moments occur;
3. compares every logged step of the drill (a step redone after a restart is logged again,
   and must agree too) with the reference, exactly, and prints one row per fault (kind, moment,
   rank, last step logged before the fault, step resumed from, steps lost, recovery seconds)
   and the totals: faults injected, restarts (by torchrun / relaunches), steps lost, time lost
   (drill wall time minus the reference's), verdict. Exit code 0 only when the curves match and
   every fault was injected.

`--shrink` is the elastic path: a fault loses its ranks for good. torchrun runs with
--max-restarts 0, so a SIGKILL ends the launch, and the drill relaunches the same command on the
next smaller world the job can run on (as a scheduler would on the nodes left), where the run
resumes from its checkpoint with dp re-derived and `--elastic-batch keep`. The table shows each
fault's world before and after, and the world-size changes the job recorded in its metrics file.
The job is one whose resize is bit-identical where the reduction order allows
(docs/architecture/decisions.md, "Elastic resize"): a Llama-flavoured model (untied embeddings), no dropout
(dp replicas share dropout masks, so another dp changes which mask meets which sample), ZeRO 0,
and one microbatch per rank on the first world (global batch micro * dp), so that after one
halving every gradient is still a sum of two terms.
Every step's loss must then equal the reference's within --shrink-rtol (default 2^-22: a few
float32 roundings of a rank's summed microbatch losses); the verdict says whether it was exact.

Linux only (workers are found through /proc). Everything runs under --workdir (default: a new
temporary directory), one log per launch.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file is loaded
from fault_drill_chaos import chaos_main  # noqa: E402
from fault_drill_plan import (MOMENTS, SCRIPT, Fault, compare_curves, job_flags, largest_difference,  # noqa: E402
                              plan_faults, read_losses, read_resizes, shrink_worlds, steps_lost)

from megalite.cli import OneLineParser  # noqa: E402
from megalite.training.metrics_file import read_records  # noqa: E402
from megalite.errors import UsageError, reports_usage_errors  # noqa: E402

__all__ = ["MOMENTS", "compare_curves", "job_flags", "main", "parse_args", "plan_faults", "shrink_worlds", "steps_lost"]


# ---------------------------------------------------------------------------------------------
# Processes: torchrun launches and their workers
# ---------------------------------------------------------------------------------------------


def _workers(agent_pid: int) -> dict[int, int]:
    """{global rank: pid} of the live worker processes torchrun (pid `agent_pid`) started."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != agent_pid or fields[0] == "Z":
                continue
            env = dict(item.split("=", 1) for item in
                       Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry)
    return found


class Job:
    """examples/pretrain_gpt.py under torchrun, relaunched with the same command until it finishes."""

    def __init__(self, args, name: str):
        self.args, self.name = args, name
        self.dir = Path(args.workdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt, self.metrics = self.dir / "ckpt", self.dir / "metrics.jsonl"
        self.process: subprocess.Popen | None = None
        self.launches = 0

    def command(self, world_size: int) -> list[str]:
        a = self.args
        rendezvous = ["--master-port", str(a.master_port)] if a.master_port else ["--standalone"]
        restarts = 0 if a.shrink else a.faults  # --shrink: a lost rank ends the launch; the drill relaunches smaller
        return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node", str(world_size),
                "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(SCRIPT), *job_flags(a),
                "--train-iters", str(a.train_iters), "--save", str(self.ckpt), "--load", str(self.ckpt),
                "--save-interval", str(a.save_interval), "--async-save", "--log-interval", "1",
                "--metrics-file", str(self.metrics)]

    def launch(self, world_size: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MEGALITE_FAULT"))}
        env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
                   MEGALITE_CHECKPOINT_WRITE_DELAY_S=str(self.args.write_delay),
                   MEGALITE_CHECKPOINT_WRITE_HOLD=str(self.hold_dir(self.launches)))
        with open(self.dir / f"launch{self.launches}.log", "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.command(world_size), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.launches += 1

    def hold_dir(self, launch: int) -> Path:
        """Launch `launch`'s write-window hold (megalite.checkpoint.save.hold_if_armed): armed before
        that launch saves, so the window is waited for on a file, whatever the machine's load."""
        path = self.dir / f"hold{launch}"
        path.mkdir(exist_ok=True)
        return path

    def finished(self) -> bool:
        logged = read_losses(self.metrics)
        return bool(logged) and logged[-1][0] == self.args.train_iters

    def workers(self) -> dict[int, int]:
        return _workers(self.process.pid) if self.process and self.process.poll() is None else {}

    def attempts(self) -> int:
        """Starts of the training script over all launches (rank 0 says 'loaded' or 'from scratch' once each)."""
        text = "".join(log.read_text(errors="replace") for log in sorted(self.dir.glob("launch*.log")))
        return text.count("megalite: loaded ") + text.count("yet; starting from scratch")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the session this drill started
            self.process.wait()


def _wait(condition, timeout_s: float, what: str, poll_s: float = 0.005):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"fault drill: {what} did not happen within {timeout_s:.0f} s")


# ---------------------------------------------------------------------------------------------
# The drill
# ---------------------------------------------------------------------------------------------


class Drill:
    def __init__(self, args, step_time_s: float):
        self.args, self.step_time_s = args, step_time_s
        self.job = Job(args, "drill")
        self.worlds = shrink_worlds(args) if args.shrink else [args.nproc]
        self.world = self.worlds[0]  # ranks of the running (or last) launch
        self.lost_ranks = False  # --shrink: a fault hit the running launch; the next one has fewer ranks

    def next_launch_world_size(self) -> int:
        """World size of the next launch: the same, or under --shrink after a fault the next smaller
        world the job can run on (the smallest stays once reached)."""
        if self.lost_ranks:
            self.world = next((w for w in self.worlds if w < self.world), self.world)
            self.lost_ranks = False
        return self.world

    def ensure_running(self) -> None:
        """Relaunch the same command when the job stopped early: a SIGTERM saved and exited 0, or
        (--shrink) a SIGKILL ended the launch."""
        code = self.job.process.poll() if self.job.process else 0
        if code is None:
            return
        if code != 0 and not self.lost_ranks:
            raise RuntimeError(f"fault drill: torchrun exited with {code}; see {self.job.dir}/launch*.log")
        if not self.job.finished():
            self.job.launch(self.next_launch_world_size())

    def training(self) -> bool:
        """True once the running attempt's workers exist and a step has been logged."""
        self.ensure_running()
        return bool(read_losses(self.job.metrics)) and bool(self.job.workers())

    def wait_for_moment(self, fault: Fault) -> str:
        latest = self.job.ckpt / "latest"
        if fault.moment == "during-async-write":  # a shard written into step_N.tmp/, held before its marker
            hold = self.job.hold_dir(self.job.launches - 1)
            (hold / "arm").touch()  # normally armed already, before this launch (or restart) began
            # the job cannot end while a writer is held: wait for the file even once the last step is logged
            if self._poll(lambda: any(hold.glob("held_r*")), until_finished=False):
                return fault.moment
            self.disarm()
        elif fault.moment == "after-save":
            current = latest.read_text() if latest.exists() else ""
            if self._poll(lambda: latest.exists() and latest.read_text() != current):
                return fault.moment
        else:
            time.sleep(fault.delay_fraction * 2 * self.args.save_interval * self.step_time_s)
            return fault.moment
        return "random (the moment did not come)"

    def arm_for(self, fault: Fault | None, previous: Fault | None) -> None:
        """Arm the write hold of the launch `fault` will hit, when its moment is a write: the running
        launch after a SIGKILL that torchrun restarts in place, else the next launch."""
        if fault is None or fault.moment != "during-async-write":
            return
        relaunched = previous is not None and (previous.kind == "SIGTERM" or self.args.shrink)
        (self.job.hold_dir(self.job.launches if relaunched or previous is None else self.job.launches - 1)
         / "arm").touch()

    def disarm(self) -> None:
        for hold in self.job.dir.glob("hold*"):
            (hold / "arm").unlink(missing_ok=True)

    def _poll(self, condition, until_finished: bool = True) -> bool:
        deadline = time.monotonic() + self.args.moment_timeout
        while time.monotonic() < deadline and not (until_finished and self.job.finished()):
            if condition():
                return True
            time.sleep(0.002)
        return False

    def inject(self, fault: Fault, started: float, next_fault: Fault | None = None) -> bool:
        """Wait for the moment, signal the victim, wait until training resumes. False if the job ended first."""
        _wait(lambda: self.training() or self.job.finished(), self.args.timeout, "training", poll_s=0.02)
        fault.moment_seen = self.wait_for_moment(fault)
        fault.world_before = self.world
        victims = self._signal(fault)
        self.disarm()  # the held writers go on (the victim's signal is already sent)
        self.arm_for(next_fault, fault)
        if not victims:
            return False
        self.lost_ranks = self.args.shrink
        killed_at = time.monotonic()
        fault.at_s = killed_at - started
        # Recovered: new worker processes (a torchrun restart, or a relaunch) have logged a step.
        old = set(victims.values())
        _wait(lambda: self._new_workers(old) or self.job.finished(), self.args.timeout,
              f"a restart after {fault.kind}", poll_s=0.02)
        logged = read_losses(self.job.metrics)  # the old attempt is gone: later records are the new one's
        fault.last_logged_step = logged[-1][0] if logged else 0
        _wait(lambda: len(read_losses(self.job.metrics)) > len(logged) or self.job.finished(), self.args.timeout,
              "training after the restart", poll_s=0.02)
        fault.recovery_s = time.monotonic() - killed_at
        now = read_losses(self.job.metrics)
        fault.resumed_from = now[len(logged)][0] - 1 if len(now) > len(logged) else fault.last_logged_step
        fault.world_after = self.world
        return True

    def _signal(self, fault: Fault) -> dict[int, int]:
        """Send the fault's signal to its rank (or the lowest live one); return the workers then alive."""
        for _ in range(100):
            victims = self.job.workers()
            if self.job.finished() or not victims:
                return {}
            try:
                os.kill(victims.get(fault.rank) or victims[min(victims)], getattr(signal, fault.kind))
                return victims
            except ProcessLookupError:  # exited between the look-up and the signal
                time.sleep(0.01)
        return {}

    def _new_workers(self, old: set[int]) -> bool:
        self.ensure_running()
        workers = set(self.job.workers().values())
        return bool(workers) and not workers & old

    def run(self, faults: list[Fault]) -> tuple[float, int]:
        """Run the job to the end with `faults`; return (wall seconds, faults injected)."""
        started, injected = time.monotonic(), 0
        self.arm_for(faults[0] if faults else None, None)
        self.job.launch(self.next_launch_world_size())
        try:
            for i, fault in enumerate(faults):
                if not self.inject(fault, started, faults[i + 1] if i + 1 < len(faults) else None):
                    break
                injected += 1
            _wait(lambda: (self.ensure_running() or True) and self.job.finished() and self.job.process.poll() == 0,
                  self.args.timeout, "the end of the job")
        finally:
            self.job.stop()
        return time.monotonic() - started, injected


def check_job(args) -> None:
    """The job's own check of its flags on --nproc ranks (its --dry-run), before any launch: a flag the
    job refuses is its one line and exit 2 here, not a failed reference run and a traceback."""
    env = {**os.environ, "WORLD_SIZE": str(args.nproc)}
    done = subprocess.run([sys.executable, str(SCRIPT), *job_flags(args), "--train-iters", str(args.train_iters),
                           "--dry-run"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        raise UsageError(f"the drilled job refuses its flags: {' '.join(line.strip() for line in lines)}")


def run_reference(args) -> tuple[float, dict[int, float], float]:
    """(wall seconds, {step: loss}, median step seconds) of the uninterrupted job."""
    job = Job(args, "reference")
    started = time.monotonic()
    job.launch(args.nproc)
    try:
        code = job.process.wait(timeout=args.timeout)
    finally:
        job.stop()
    if code != 0 or not job.finished():
        raise RuntimeError(f"fault drill: the reference run failed ({code}); see {job.dir}/launch0.log")
    steps = [r["step_time_s"] for r in read_records(job.metrics) if "step_time_s" in r]
    return time.monotonic() - started, dict(read_losses(job.metrics)), statistics.median(steps)


def report(faults, injected, reference_s, drill_s, logged, mismatch, job: Job, args, reference) -> str:
    rows = [f"{'#':>2} {'kind':<8} {'moment':<34} {'rank':>4} {'at s':>6} {'last step':>9} {'resumed':>7} "
            f"{'lost':>4} {'recovery s':>10} {'world':>6}"]
    for i, f in enumerate(faults[:injected], 1):
        lost = f.last_logged_step - f.resumed_from if f.resumed_from is not None else 0
        world = str(f.world_before) if f.world_before == f.world_after else f"{f.world_before}->{f.world_after}"
        rows.append(f"{i:>2} {f.kind:<8} {f.moment_seen:<34} {f.rank:>4} {f.at_s:>6.1f} {f.last_logged_step:>9} "
                    f"{f.resumed_from:>7} {max(0, lost):>4} {f.recovery_s:>10.1f} {world:>6}")
    relaunches = job.launches - 1
    restarts = job.attempts() - 1
    resizes = [f"{r['old_world_size']} -> {r['new_world_size']} after step {r['step']} (dp {r['old_dp']} -> "
               f"{r['new_dp']}, global batch {r['new_global_batch_size']} {r['batch_rule']}, accumulation "
               f"{r['old_num_microbatches']} -> {r['new_num_microbatches']})" for r in read_resizes(job.metrics)]
    if mismatch is None and injected == len(faults):
        difference, step = largest_difference(reference, logged)
        verdict = "MATCH: every logged step equals the uninterrupted run exactly" if difference == 0 else \
            (f"MATCH: every logged step within {args.shrink_rtol:.2g} relative of the uninterrupted run (largest "
             f"difference {difference:.2g} at step {step})")
    else:
        verdict = f"FAIL: {mismatch or f'only {injected} of {len(faults)} faults injected'}"
    rows += ["",
             f"faults injected: {injected} of {len(faults)}",
             f"restarts: {restarts} ({restarts - relaunches} by torchrun, {relaunches} relaunches after SIGTERM"
             + (" or lost ranks" if args.shrink else "") + ")",
             f"world-size changes: {', '.join(resizes) or 'none'}",
             f"steps lost: {steps_lost(logged)} (redone after restarts, of {args.train_iters})",
             f"time lost: {drill_s - reference_s:.1f} s (drill {drill_s:.1f} s, uninterrupted {reference_s:.1f} s)",
             f"verdict: {verdict}"]
    return "\n".join(rows)


def parse_args(argv):
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--faults", type=int, default=3, help="how many workers to signal (default 3)")
    p.add_argument("--seed", type=int, default=0, help="picks kinds, moments, victims and delays")
    p.add_argument("--nproc", type=int, default=2, help="workers per launch (torchrun --nproc_per_node)")
    p.add_argument("--train-iters", type=int, default=48)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--write-delay", type=float, default=0.3,
                   help="seconds each shard write is held back (a slow file system): the during-write window")
    p.add_argument("--master-port", type=int, default=None, help="launch with --master-port (default --standalone)")
    p.add_argument("--workdir", default=None, help="where checkpoints, metrics and logs go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--moment-timeout", type=float, default=20.0, help="seconds to wait for a save or write moment")
    p.add_argument("--shrink", action="store_true",
                   help="every fault loses its ranks for good: relaunch on the next smaller world (elastic resize)")
    p.add_argument("--shrink-rtol", type=float, default=2.0 ** -22,
                   help="--shrink: largest relative loss difference from the uninterrupted run (default 2^-22: a few "
                        "float32 roundings of a rank's summed microbatch losses)")
    p.add_argument("job_args", nargs="*", help="after --: more examples/pretrain_gpt.py flags (e.g. -- --tp 2)")
    args = p.parse_args(argv)
    if args.faults < 0 or args.nproc < 1:
        p.error("--faults must be >= 0 and --nproc >= 1")
    return args


@reports_usage_errors
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--chaos" in argv:  # recovery without a restart (tools/fault_drill_chaos.py)
        return chaos_main([a for a in argv if a != "--chaos"])
    args = parse_args(argv)
    check_job(args)  # before anything is made or launched
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="megalite-fault-drill-")  # made only by a drill that runs
    print(f"fault drill: {args.faults} faults, {args.nproc} workers, seed {args.seed}, in {args.workdir}", flush=True)
    drill = Drill(args, 0.0)
    if args.shrink:
        if len(drill.worlds) < 2:
            raise SystemExit(f"fault drill: --shrink: the job runs on no world smaller than {args.nproc} ranks")
        print(f"fault drill: --shrink: worlds {' -> '.join(map(str, drill.worlds))}", flush=True)
    reference_s, reference, drill.step_time_s = run_reference(args)
    faults = plan_faults(args.faults, args.nproc, args.seed)
    drill_s, injected = drill.run(faults)
    logged = read_losses(drill.job.metrics)
    mismatch = compare_curves(reference, logged, args.train_iters, args.shrink_rtol if args.shrink else 0.0)
    print(report(faults, injected, reference_s, drill_s, logged, mismatch, drill.job, args, reference))
    return 0 if mismatch is None and injected == len(faults) else 1


if __name__ == "__main__":
    sys.exit(main())
