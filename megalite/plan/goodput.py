"""Goodput you can plan: the checkpoint interval and the share of wall time that trains, for restart-only
recovery against in-place recovery of replica groups (the blueprint's decision 16: replica groups fail alone; docs/goodput.md).

Failures arrive as a Poisson process at the job's rate λ = GPUs / MTBF per GPU (or nodes / MTBF per
node); M = 1/λ is the job's mean time between failures. Times in seconds.

Restart-only (every failure stops the whole job). The job trains τ seconds, then blocks δ to save a
checkpoint; a failure loses the segment in progress (the work since the last checkpoint, which is
replayed) and costs D = restart + load seconds before the segment starts again; a failure during D
starts D again. Per segment of T = τ + δ the expected wall time is e^{λD}(e^{λT} - 1)/λ (each attempt
restarts a memoryless clock), so

    goodput(τ) = τ λ e^{-λD} / (e^{λ(τ+δ)} - 1)

exactly, for this model. The interval: Young (1974) τ = sqrt(2δM); Daly (2006) τ = sqrt(2δM)·(1 +
sqrt(δ/(2M))/3 + δ/(18M)) - δ (δ < 2M, else M); and the exact optimum of goodput(τ), found numerically.

In-place (torchft's design: quorum per step, the failed replica group dropped from the step): a
failure takes one of K replica groups out for restart + heal seconds (it receives the live state from
a peer: no checkpoint is read) while the other K - 1 keep stepping; it loses that group's share of
the step in flight (half a step on average) and its share of the job while it is out. Checkpoints are
still written at the restart-only optimum (the same durability), so

    goodput = τ/(τ + δ) · (1 - λ (restart + heal + step/2) / K)

to first order (a failure of a group already out loses nothing more, so this is a hair low).
`monte_carlo` replays random failure traces of both models (seeded) to check the formulas.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Failures:
    """What the planner needs to know about failures and recovery (seconds)."""

    job_mtbf_s: float  # M: the whole job's mean time between failures
    save_s: float  # δ: training blocked per checkpoint save
    load_s: float  # a checkpoint load after a restart
    restart_s: float  # processes back and the job rebuilt (or one replica group's, in place)
    heal_s: float = 0.0  # in place: the restarted group receives the live state from a peer
    step_s: float = 0.0  # one training step (in place: the failed group's step in flight is dropped)
    replica_groups: int = 1  # K: the dp/S groups that fail alone

    @classmethod
    def from_hardware(cls, gpus: int, *, mtbf_hours: float, per: str = "gpu", gpus_per_node: int = 8,
                      **times: float) -> "Failures":
        """M from an MTBF per GPU (`per` = "gpu") or per node ("node", `gpus_per_node` a node)."""
        units = gpus if per == "gpu" else math.ceil(gpus / gpus_per_node)
        return cls(job_mtbf_s=mtbf_hours * 3600.0 / units, **times)


def restart_goodput(f: Failures, interval_s: float) -> float:
    """Restart-only goodput at a checkpoint every `interval_s` seconds of training (exact, see above)."""
    lam = 1.0 / f.job_mtbf_s
    return interval_s * lam * math.exp(-lam * (f.restart_s + f.load_s)) / math.expm1(lam * (interval_s + f.save_s))


def young_interval(f: Failures) -> float:
    return math.sqrt(2.0 * f.save_s * f.job_mtbf_s)


def daly_interval(f: Failures) -> float:
    m, d = f.job_mtbf_s, f.save_s
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


def optimal_interval(f: Failures) -> float:
    """The τ that maximises `restart_goodput` (golden-section search on log τ; the function is unimodal)."""
    lo, hi = math.log(max(1e-3, f.save_s * 1e-3)), math.log(f.job_mtbf_s * 10 + f.save_s)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if restart_goodput(f, math.exp(a)) < restart_goodput(f, math.exp(b)):
            lo = a
        else:
            hi = b
    return math.exp((lo + hi) / 2)


def inplace_goodput(f: Failures, interval_s: float) -> float:
    """In-place recovery's goodput, checkpoints every `interval_s` (first order, see the module docstring)."""
    lost = (f.restart_s + f.heal_s + f.step_s / 2) / (f.replica_groups * f.job_mtbf_s)
    return interval_s / (interval_s + f.save_s) * max(0.0, 1.0 - lost)


@dataclass(frozen=True)
class GoodputPlan:
    job_mtbf_s: float
    young_interval_s: float
    daly_interval_s: float
    optimal_interval_s: float
    restart_goodput: float  # at the optimal interval
    inplace_goodput: float  # at the same interval
    replica_groups: int

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return "\n".join([
            f"job MTBF {self.job_mtbf_s / 3600:.2f} h ({self.job_mtbf_s:.0f} s)",
            f"checkpoint interval: Young {self.young_interval_s:.0f} s, Daly {self.daly_interval_s:.0f} s, "
            f"optimal for this model {self.optimal_interval_s:.0f} s",
            f"goodput, restart-only recovery: {100 * self.restart_goodput:.2f}%",
            f"goodput, in-place recovery of {self.replica_groups} replica groups: {100 * self.inplace_goodput:.2f}%"])


def plan_goodput(f: Failures) -> GoodputPlan:
    best = optimal_interval(f)
    return GoodputPlan(f.job_mtbf_s, young_interval(f), daly_interval(f), best, restart_goodput(f, best),
                       inplace_goodput(f, best), f.replica_groups)


def monte_carlo(f: Failures, interval_s: float, *, horizon_s: float, seed: int = 0) -> tuple[float, float]:
    """(restart-only, in-place) goodput measured on random failure traces of `horizon_s` wall seconds."""
    return _restart_trace(f, interval_s, horizon_s, random.Random(seed)), \
        _inplace_trace(f, interval_s, horizon_s, random.Random(seed + 1))


def _restart_trace(f: Failures, interval_s: float, horizon_s: float, rng: random.Random) -> float:
    """Segments of training + save until the horizon; a failure loses the segment in progress, then
    restart + load (a failure during them starts them again)."""
    lam, down, segment = 1.0 / f.job_mtbf_s, f.restart_s + f.load_s, interval_s + f.save_s
    now, done = 0.0, 0.0
    next_failure = rng.expovariate(lam)
    while now < horizon_s:
        if next_failure >= now + segment:  # the segment and its save complete
            now += segment
            done += interval_s
            continue
        now = next_failure  # the segment is lost
        while True:  # recovery: restart and load
            next_failure = now + rng.expovariate(lam)
            if next_failure >= now + down:
                now += down
                break
            now = next_failure
    return done / now


def _inplace_trace(f: Failures, interval_s: float, horizon_s: float, rng: random.Random) -> float:
    """Group outages over the trace: work = alive share x training time, less each failure's partial step."""
    k, lam, out_for = f.replica_groups, 1.0 / f.job_mtbf_s, f.restart_s + f.heal_s
    back_at = [0.0] * k  # when each group is back
    lost, t = 0.0, rng.expovariate(lam)
    while t < horizon_s:
        group = rng.randrange(k)
        if back_at[group] <= t:  # a group already out loses nothing more
            start = t
            lost += rng.random() * f.step_s / k  # its share of the step in flight, dropped from the step
            lost += (min(t + out_for, horizon_s) - start) / k
            back_at[group] = t + out_for
        t += rng.expovariate(lam)
    training = horizon_s * interval_s / (interval_s + f.save_s)  # saves block every group alike
    return (training - lost * interval_s / (interval_s + f.save_s)) / horizon_s
