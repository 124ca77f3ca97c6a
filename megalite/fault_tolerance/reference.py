"""The deterministic reference of a fault-tolerant run: one process, the same samples dropped.

A fault-tolerant run's records (replica_group.py, one JSON line per group and step) name each step's
members. The reference trains the same model in one process on exactly the samples of those members
at each step (settings.py addresses every sample by id), through the same gradient and update code:
the step's gradient is the mean over the surviving samples' target tokens. Each member's gradient is
computed on its own and the members' are summed in order, as the run's all-reduce sums them: with one
or two members (a + b is b + a) the reference is the run bit for bit; with three, gloo's ring adds
each chunk in its own order, so the losses agree to rounding.
"""
from __future__ import annotations

from megalite.fault_tolerance.replica_group import build_stack, fingerprint, local_gradient, update
from megalite.fault_tolerance.settings import FaultTolerantRun


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


def reference_run(run: FaultTolerantRun, members: dict[int, tuple[int, ...]]) -> list[tuple[float, str]]:
    """Per step, (loss, parameter fingerprint) of one process trained on the members' samples only."""
    model, optimizer = build_stack(run)
    out = []
    for step in sorted(members):
        grad, totals = None, None
        for group in members[step]:
            mine = local_gradient(model, optimizer, run.microbatches_of(step, [group]))
            grad = model.grad_shard.clone() if grad is None else grad.add_(model.grad_shard)
            totals = mine if totals is None else totals + mine
        model.grad_shard.copy_(grad)
        out.append((update(model, optimizer, totals, run.lr), fingerprint(optimizer)))
    return out
