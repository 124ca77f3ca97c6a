"""The deterministic reference of a fault-tolerant run: one process, the same samples dropped.

A fault-tolerant run's records (replica_group.py, one JSON line per rank, group and step) name each
step's members. The reference trains the same model as one replica group of the run's W ranks (one
process at W = 1; a forked gloo world of W otherwise, the same ZeRO shards) on exactly the samples of
those members at each step (settings.py addresses every sample by id), through the same gradient and
update code: the step's gradient is the mean over the surviving samples' target tokens. Each member's
gradient is computed on its own (its W ranks' reduce-scattered as in its group) and the members' are
summed in float64 in order, as the run's all-reduce sums them, then rounded to fp32: with one or two
members (a + b is b + a) the reference is the run bit for bit; with three, gloo's ring adds each chunk
in its own order, so the losses agree to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.distributed.mesh import current_mesh
from megalite.fault_tolerance.group_stack import build_stack, fingerprint, local_gradient, update
from megalite.fault_tolerance.settings import FaultTolerantRun
from megalite.testing import run_distributed


def members_by_step(records: list[dict]) -> dict[int, tuple[int, ...]]:
    """{step: its members} from every group's records; raises when two groups saw different members
    (a split quorum) or a step is missing (training stopped)."""
    members: dict[int, tuple[int, ...]] = {}
    for record in records:
        seen = members.setdefault(record["step"], tuple(record["members"]))
        if seen != tuple(record["members"]):
            raise AssertionError(f"step {record['step']}: groups disagree on the members ({seen} and "
                                 f"{tuple(record['members'])})")
    missing = sorted(set(range(max(members, default=-1) + 1)) - set(members))
    if missing:
        raise AssertionError(f"steps {missing} have no record: training stopped")
    return members


def reference_run(run: FaultTolerantRun, members: dict[int, tuple[int, ...]]) -> list[list[tuple[float, str]]]:
    """Per rank of a group, per step, (loss, fingerprint of the rank's shard) of one replica group trained
    on the members' samples only; on one intra-op thread, as the groups' processes run (a matmul's sum is
    ordered by its threads)."""
    if run.ranks_per_group > 1:
        return run_distributed(_reference_steps, run.ranks_per_group, run, members, timeout_s=600)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_reference_steps(run, members)]
    finally:
        torch.set_num_threads(threads)


def _reference_steps(run: FaultTolerantRun, members: dict[int, tuple[int, ...]]) -> list[tuple[float, str]]:
    model, optimizer = build_stack(run)
    rank = current_mesh().rank if run.ranks_per_group > 1 else None
    out = []
    for step in sorted(members):
        grad, totals = None, None
        for group in members[step]:
            mine = local_gradient(model, optimizer, run.microbatches_of(step, [group], rank))
            grad = model.grad_shard.double() if grad is None else grad.add_(model.grad_shard.double())
            totals = mine if totals is None else totals + mine
        model.grad_shard.copy_(grad)
        out.append((update(model, optimizer, totals, run.lr), fingerprint(optimizer)))
    return out


@dataclass(frozen=True)
class Verdict:
    """A fault-tolerant run's records against its reference (what `verify` found)."""

    steps: int
    dropped: dict[int, tuple[int, ...]]  # step -> replica groups whose samples it dropped
    heals: list[tuple[int, int]]  # (step, group) of every heal
    members_agree: bool  # every member of every step logged the same loss and parameter bytes
    losses_bitwise: bool  # the run's losses equal the reference's exactly
    params_bitwise: bool  # and its parameters after every step (possible while steps have <= 2 members)
    max_loss_rel_diff: float

    @property
    def nothing_lost(self) -> bool:
        return self.members_agree and self.max_loss_rel_diff <= LOSS_RTOL


LOSS_RTOL = 1e-5  # the project's parity tolerance; three members: gloo's ring adds each chunk in its own
# order, and the roundings compound through Adam (measured 5e-8 after 30 steps, 1.0e-6 after 60)


def verify(run: FaultTolerantRun, records: list[dict]) -> Verdict:
    """Check a run's records: no step missing, members agreeing bit for bit (rank by rank), the reference's
    losses and shards."""
    members = members_by_step(records)
    by_step: dict[tuple[int, int], list[dict]] = {}  # (step, rank) -> the members' records
    for record in records:
        by_step.setdefault((record["step"], record.get("rank", 0)), []).append(record)
    agree = all(len({(r["loss"], r["fingerprint"]) for r in rs}) == 1 and
                {r["group"] for r in rs} <= set(members[s]) for (s, _), rs in by_step.items())
    reference = reference_run(run, members)
    ran = [[(by_step[s, rank][0]["loss"], by_step[s, rank][0]["fingerprint"]) for s in sorted(members)]
           for rank in range(len(reference))]
    rel = max(abs(a[0] - b[0]) / abs(b[0]) for mine, ref in zip(ran, reference) for a, b in zip(mine, ref))
    return Verdict(steps=len(members), dropped={s: tuple(g for g in range(run.groups) if g not in m)
                                                for s, m in members.items() if len(m) < run.groups},
                   heals=sorted({(r["step"], r["group"]) for r in records if r["healed"]}),
                   members_agree=agree,
                   losses_bitwise=all([a[0] for a in mine] == [b[0] for b in ref] for mine, ref in zip(ran, reference)),
                   params_bitwise=all([a[1] for a in mine] == [b[1] for b in ref] for mine, ref in zip(ran, reference)),
                   max_loss_rel_diff=rel)
