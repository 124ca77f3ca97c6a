"""Numerical guards: non-finite losses and gradients, and replicas (dp, tp) drifting apart.

Non-finite loss or gradients (`--on-nonfinite {skip, stop}`)
    The gradient half is already done by DistributedOptimizer: it computes the global grad
    norm over the whole mesh anyway, and skips the update on every rank when that norm is not
    finite. `NonFiniteGuard` adds what is missing, without a second pass over the gradients:

    - the loss check *before* the update: `loss_is_finite(local_loss_sum)` is one 1-element
      all-reduce over the world (only the last pipeline stage holds a loss), for train_step to
      call just before `optimizer.step` and skip on; without that hook, `check` still sees the
      non-finite loss in train_step's result (global, so the same on every rank) one step late
      for the update, and says so;
    - the policy: 'skip' logs and trains on, 'stop' raises `NonFiniteError` on every rank
      together (every rank reads the same global loss and norm, so none is left in a collective);
    - the report: the global sample indices of the step, gathered from every dp rank with one
      `all_gather_object` over the dp group, only when something is wrong (the cp ranks of a
      dp rank read the same samples, so the dp group alone names them all).

    Under fp16 a non-finite gradient with a finite loss is the dynamic loss scaler's ordinary
    overflow (the optimizer skips and backs the scale off): not an event unless asked for.

Replica consistency (`--check-replicas-interval K`)
    Data-parallel replicas must hold bit-identical parameters (ZeRO all-gathers them from one
    owner; plain dp applies identical all-reduced gradients), and so must the tp ranks' copies
    of tp-replicated parameters (norms, row-parallel biases: each tp rank updates its copy
    from gradients that must agree; a non-deterministic kernel or a missed all-reduce under
    sequence parallelism makes them drift silently). Context-parallel ranks hold replicas too
    (the same weights, other tokens): the replicas are those of the dp x cp group.
    `check_replicas` reduces every parameter
    to a bit-exact checksum (the sum of its bit patterns as integers and a neighbour-xor sum
    that also sees swapped elements) and compares them with one all-gather over the dp (x cp) group
    and one over the tp group, plus a 1-element all-reduce over the world so that every rank
    stops together when any group disagrees. The error names the first mismatching parameter
    (in model order, by logical name) and which ranks disagree.
"""
from __future__ import annotations

import math
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from megalite.config.choices import OnNonFinite
from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.distributed.mesh import Mesh
from megalite.training.step_result import StepResult

ON_NONFINITE_CHOICES = ("skip", "stop")
NONFINITE_EXIT_CODE = 3  # suggested exit status of a run stopped by --on-nonfinite stop
REPLICA_MISMATCH_EXIT_CODE = 4  # ... and of one stopped by --check-replicas-interval


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under --on-nonfinite stop (raised on every rank)."""


class ReplicaMismatchError(RuntimeError):
    """Replicas (dp, or tp copies of replicated parameters) differ (raised on every rank)."""


def _log_rank0(message: str) -> None:
    if comm.global_rank() == 0:
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Non-finite loss and gradients
# ---------------------------------------------------------------------------------------------


@dataclass
class NonFiniteEvent:
    """One step whose loss or gradients were not finite."""

    step: int
    loss: float
    grad_norm: float
    bad_loss: bool
    bad_grads: bool
    update_applied: bool  # True only when the loss was bad, the gradients finite, and no pre-step hook ran
    sample_indices: dict[int, Any] = field(default_factory=dict)  # dp rank -> that rank's sample indices
    action: str = "skip"

    def describe(self) -> str:
        what = " and ".join(x for x, bad in (("loss", self.bad_loss), ("gradients", self.bad_grads)) if bad)
        update = "the optimizer update WAS applied (gradients were finite)" if self.update_applied \
            else "the optimizer update was skipped on every rank"
        action = "stopping (--on-nonfinite stop)" if self.action == OnNonFinite.STOP else "training on (--on-nonfinite skip)"
        samples = "; ".join(f"dp rank {r}: {idx}" for r, idx in sorted(self.sample_indices.items()))
        return (f"step {self.step}: non-finite {what} (loss {self.loss}, grad norm {self.grad_norm}); {update}; "
                f"{action}. Global sample indices of this step: {samples}")


class NonFiniteGuard:
    """--on-nonfinite: catch non-finite losses and gradients, report the step's samples, skip or stop.

    Args:
        mesh: the Mesh (dp group to gather sample indices; world for the loss agreement).
        policy: 'skip' (log, leave the update skipped, go on) or 'stop' (raise NonFiniteError).
        loss_scaling: True under fp16 dynamic loss scaling, where overflowing gradients with a
            finite loss are routine (the scaler backs off) and are not reported.
        log: where event descriptions go (default: stderr on global rank 0).
    """

    def __init__(self, mesh: Mesh, policy: str = "skip", *, loss_scaling: bool = False,
                 log: Callable[[str], None] | None = None, max_skipped: int = 0):
        if policy not in ON_NONFINITE_CHOICES:
            raise ValueError(f"--on-nonfinite must be one of {ON_NONFINITE_CHOICES}, got {policy!r}")
        self.mesh, self.policy, self.loss_scaling = mesh, policy, loss_scaling
        self.log = log or _log_rank0
        self.events: list[NonFiniteEvent] = []
        self.max_skipped = max_skipped  # --max-skipped-steps: consecutive skipped updates that stop the run (0: never)
        self.skipped_in_a_row = 0
        self.skipped_total = 0  # updates skipped in this run (the fp16 console line shows it, as Megatron's does)

    def loss_is_finite(self, local_loss_sum: float | torch.Tensor) -> bool:
        """Before the optimizer step: True on every rank iff every rank's local loss is finite.

        One 1-element all-reduce (max of a 'bad' flag) over the world; ranks that hold no loss
        (not the last pipeline stage) pass 0.0.
        """
        value = float(local_loss_sum)
        bad = torch.tensor([0.0 if math.isfinite(value) else 1.0], device=self.mesh.device)
        comm.all_reduce(bad, comm.world_group(), op="max")
        return bool(bad.item() == 0.0)

    def check(self, step: int, result: StepResult, sample_indices: Any) -> NonFiniteEvent | None:
        """After train_step: report a non-finite step and apply the policy.

        `result` is train_step's StepResult: its loss (global mean, the same on every rank),
        grad_norm (global) and loss_finite (the pre-step hook's verdict) are read. `sample_indices` is this rank's share of the step as the
        sampler gave it (a list of microbatches of global sample indices); it is gathered from
        every dp rank only when the step is bad. Returns the event (also kept in `events`), or
        None for a healthy step. Raises NonFiniteError on every rank under 'stop'.
        """
        loss, grad_norm = float(result.loss), float(result.grad_norm)
        bad_loss = not math.isfinite(loss) or not result.loss_finite
        bad_grads = not math.isfinite(grad_norm)
        self._count_skipped(step, result, bad_loss)  # the same on every rank: the step's global verdict
        if not bad_loss and (not bad_grads or self.loss_scaling):
            return None
        gathered = comm.all_gather_object(sample_indices, self.mesh.dp_group)  # every rank agrees we are here
        event = NonFiniteEvent(step=step, loss=loss, grad_norm=grad_norm, bad_loss=bad_loss, bad_grads=bad_grads,
                               update_applied=not result.skipped,
                               sample_indices=dict(enumerate(gathered)), action=self.policy)
        self.events.append(event)
        self.log(f"megalite: {event.describe()}")
        if self.policy == OnNonFinite.STOP:
            raise NonFiniteError(event.describe())
        return event


    def _count_skipped(self, step: int, result: StepResult, bad_loss: bool) -> None:
        """Raise NonFiniteError (every rank) once --max-skipped-steps updates in a row were skipped:
        a run that trains nothing must not end as if it had trained."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if result.skipped else 0
        self.skipped_total += int(result.skipped)
        if not self.max_skipped or self.skipped_in_a_row < self.max_skipped:
            return
        first = step - self.skipped_in_a_row + 1
        if bad_loss:
            why = "the loss was not finite; look at the data and the learning rate (--lr)"
        elif self.loss_scaling:
            why = (f"the gradients overflowed at every fp16 loss scale down to {result.loss_scale:g}; lower "
                   f"--initial-loss-scale (e.g. 65536) or use --bf16")
        else:
            why = "the gradients were not finite; lower --lr or look at the data"
        raise NonFiniteError(f"steps {first}..{step}: {self.skipped_in_a_row} updates in a row skipped (nothing "
                             f"trained): {why}; --max-skipped-steps {self.max_skipped} stops the run here (0: never)")


# ---------------------------------------------------------------------------------------------
# Replica consistency across data parallelism
# ---------------------------------------------------------------------------------------------

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements widened to int64 at a time: bounds the temporary to 32 MB


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Bit-exact checksum of a tensor: int64 [2] = (sum of bit patterns, sum of neighbour xors).

    Equal tensors (same bits) give equal checksums on any device; a change of one bit in
    one element changes the first sum, and swapping neighbours changes the second.
    Integer sums wrap around identically everywhere, so the result is deterministic.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for chunk in bits.split(_CHUNK):
        wide = chunk.to(torch.int64)
        total[0] += wide.sum()
        total[1] += (wide[1:] ^ wide[:-1]).sum()
    return total


def parameter_checksums(named_params: Iterable[tuple[str, torch.Tensor]],
                        device: torch.device | None = None) -> tuple[list[str], torch.Tensor]:
    """(names, int64 [1 + n, 2]): row 0 identifies the name list (crc32, n), row 1 + i parameter i.

    On the parameters' device (`device` when the list is empty)."""
    names, rows = [], []
    for name, param in named_params:
        names.append(name)
        rows.append(tensor_checksum(param))
        device = param.device
    header = torch.tensor([[zlib.crc32("\n".join(names).encode()), len(names)]], dtype=torch.int64, device=device)
    return names, torch.cat([header] + [r.view(1, 2) for r in rows])


_KINDS = {"dp": ("data-parallel replicas", "dp"), "tp": ("tensor-parallel ranks", "tp"),
          "dp_cp": ("data- and context-parallel replicas", "dp x cp"),
          "edp": ("expert-data-parallel replicas", "expert-dp"),
          "dp_replicate": ("the replica groups of --dp-shard", "dp_replicate")}


def describe_mismatch(name: str, checksums: list[tuple[int, int]], global_ranks: list[int], step: Any,
                      kind: str = "dp") -> str:
    """Name the parameter and the ranks that disagree: the minority when a majority exists.

    checksums[i], global_ranks[i]: of rank i of the dp group (kind 'dp'), the dp x cp group
    ('dp_cp') or the tp group ('tp')."""
    what, short = _KINDS[kind]
    groups: dict[tuple[int, int], list[int]] = {}
    for group_rank, value in enumerate(checksums):
        groups.setdefault(tuple(value), []).append(group_rank)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))

    def who(ranks: list[int]) -> str:
        return f"{short} rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (global " \
               f"{', '.join(str(global_ranks[r]) for r in ranks)})"

    def verb(ranks: list[int], singular: str, plural: str) -> str:
        return singular if len(ranks) == 1 else plural

    head = f"parameter {name!r} differs across {what} at step {step}: "
    if len(ordered[0]) > len(ordered[1]):
        odd = sorted(r for ranks in ordered[1:] for r in ranks)
        return head + f"{who(odd)} {verb(odd, 'disagrees', 'disagree')} with the majority, {who(ordered[0])}"
    return head + "; ".join(f"{who(r)} {verb(r, 'holds', 'hold')} one value" for r in ordered) + " (no majority)"


def _first_mismatch(named_params: list[tuple[str, torch.Tensor]], group, global_ranks: list[int], kind: str,
                    step: Any, device: torch.device) -> str | None:
    """All-gather the checksums over `group` (every member passes the same list); describe the
    first parameter, in model order, on which the members disagree."""
    names, local = parameter_checksums(named_params, device)
    gathered = comm.all_gather(local.unsqueeze(0), group).cpu()  # [group size, 1 + n, 2]
    what, _ = _KINDS[kind]
    if not bool((gathered[:, 0] == gathered[0, 0]).all()):
        return (f"replica check at step {step}: {what} (global ranks {global_ranks}) hold different parameter "
                f"lists (crc32/count {gathered[:, 0].tolist()}); the model was built differently")
    same = (gathered[:, 1:] == gathered[0, 1:]).all(dim=-1).all(dim=0)  # [n]: agrees on every member
    bad = (~same).nonzero().flatten().tolist()
    if not bad:
        return None
    first = bad[0]
    message = describe_mismatch(names[first], [tuple(gathered[r, 1 + first].tolist()) for r in range(len(global_ranks))],
                                global_ranks, step, kind)
    if len(bad) > 1:
        others = [names[i] for i in bad[1:4]]
        message += f"; {len(bad) - 1} more parameter(s) differ: {others}{' ...' if len(bad) > 4 else ''}"
    return message


def _tp_replicated(param: torch.Tensor) -> bool:
    """Held whole by every tp rank (norms, biases of row-parallel layers, position embeddings)."""
    return not P.shard_spec(param).is_tp_sharded


def check_replicas(named_params: Iterable[tuple[str, torch.Tensor]], mesh: Mesh, step: Any = None,
                   shards: bool = False, replica_pieces: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
    """--check-replicas-interval: raise ReplicaMismatchError on every rank if replicas differ.

    Two kinds of replica must hold bit-identical values: the dp replicas of every parameter,
    and the tp ranks' copies of every tp-replicated parameter (those whose shard spec splits
    nothing: layer norms, row-parallel biases...), which each tp rank updates on its own from
    gradients that must agree. `named_params`: (logical name, parameter) in model order, e.g.
    from `chunk.logical_parameters()` over this rank's chunks.
    `shards=True` (ZeRO-3): `named_params` are this rank's shard pieces of the tp-replicated
    parameters (`DataParallel.tp_replicated_pieces()`); dp ranks hold different pieces, so only
    the tp ranks (same pieces) are compared. Under hybrid sharding (--dp-shard S < dp) the replica
    groups hold the same shards: `replica_pieces` (`DataParallel.shard_pieces()`, every piece of this
    rank's shard) are compared over `mesh.replicate_group` too.
    Under expert parallelism the experts (which differ across the ep ranks) are compared over the
    expert-data-parallel group instead.
    Collectives: an all-gather of int64 [1 + n, 2] over the dp x cp group (dp*cp > 1) and one over the
    tp group (tp > 1, replicated parameters only), then one 1-element all-reduce over the
    world, so that ranks of healthy groups stop too instead of hanging.
    """
    named_params = list(named_params)
    device = named_params[0][1].device if named_params else mesh.device
    messages = []
    apart = mesh.expert_replicas_apart  # experts have a replica group of their own (ep > 1, or etp = 1)
    experts = [(n, p) for n, p in named_params if apart and P.is_expert_parallel(p)]
    if mesh.dp_size * mesh.cp_size > 1 and not shards:  # the ranks that hold these same parameters
        kind = "dp" if mesh.cp_size == 1 else "dp_cp"
        ranks = comm.group_ranks(mesh.dp_cp_group)
        dense = [(n, p) for n, p in named_params if not (apart and P.is_expert_parallel(p))]
        messages.append(_first_mismatch(dense, mesh.dp_cp_group, ranks, kind, step, device))
    if experts and mesh.expert_dp_size > 1 and not shards:  # experts are replicated over expert-dp (x tp) only
        ranks = comm.group_ranks(mesh.expert_dp_group)
        messages.append(_first_mismatch(experts, mesh.expert_dp_group, ranks, "edp", step, device))
    replica_pieces = list(replica_pieces)
    if shards and mesh.replicate_group is not None:  # ZeRO-3 hybrid: the replica groups hold the same shards
        ranks = comm.group_ranks(mesh.replicate_group)
        messages.append(_first_mismatch(replica_pieces, mesh.replicate_group, ranks, "dp_replicate", step, device))
    if mesh.tp_size > 1:
        ranks = comm.group_ranks(mesh.tp_group)
        replicated = named_params if shards else [(name, p) for name, p in named_params if _tp_replicated(p)]
        messages.append(_first_mismatch(replicated, mesh.tp_group, ranks, "tp", step, device))
    message = next((m for m in messages if m), None)
    # Every rank must learn that some group disagreed: the value is world_size - (lowest such rank).
    flag = torch.tensor([float(mesh.world_size - mesh.rank) if message else 0.0], device=device)
    comm.all_reduce(flag, comm.world_group(), op="max")
    if flag.item() > 0:
        reporter = mesh.world_size - int(flag.item())
        raise ReplicaMismatchError(message or f"replica check at step {step}: replicas disagree elsewhere in the "
                                              f"mesh (see rank {reporter}'s error); stopping")
