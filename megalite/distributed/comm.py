"""The one place in megalite that calls torch.distributed.

Every collective and point-to-point transfer goes through a function here. That buys:

- exact byte accounting per (group name, op) in `ledger`, which tests compare with the
  formulas (e.g. Megatron's 4 all-reduces of b*s*h elements per layer and step) and which
  the metrics report;
- a per-rank ring buffer of the most recent ops (`recent_ops()`), so a hang can be reported
  as "rank 5 waits in all_reduce on group dp (seq 812)";
- one place to time communication.

Conventions:
- `group=None` means a group of one process: every op is then a no-op (returns its input).
  It never means "the world" (use `world_group()` for that).
- Bytes counted per call are the payload of one rank in nccl-tests terms: all_reduce and
  broadcast the tensor; all_gather the gathered output; reduce_scatter the full input;
  send/recv the tensor sent or received; all_to_all the input.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megalite import errors
from megalite.distributed import rendezvous
from megalite.distributed.ledger import Ledger, OpRecord  # noqa: F401  (OpRecord: the ring's records, read as comm.OpRecord)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch >= 2.10 names the tensor collectives *_single (the *_tensor names warn); older torch lacks them.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------
# Accounting: bytes per (group, op) and a ring buffer of recent ops (megalite/distributed/ledger.py)
# ---------------------------------------------------------------------------------------------

ledger = Ledger()


def recent_ops() -> list[OpRecord]:
    """The most recent communication ops of this process, oldest first."""
    return list(ledger.ring)


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------

_GROUP_NAMES: dict[Any, str] = {}
_NAMESPACE: str | None = None  # this start of the job's key prefix in the job's store (megalite.distributed.rendezvous)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class Transport:
    """How comm's point-to-point transfers reach the backend: torch.distributed's batch_isend_irecv.

    The world's process group is made with one (`init_process_group(transport=...)`) and every
    `batch_isend_irecv` below sends through it until the group is destroyed. --simulate's fake world
    passes one that moves nothing (megalite/simulate/fake_world.py); the ledger counts the same bytes."""

    def batch_isend_irecv(self, ops: list) -> list:
        """ops: torch.distributed.P2POp; one handle per op, or one for the batch (NCCL)."""
        return dist.batch_isend_irecv(ops)


_TRANSPORT = Transport()


def init_process_group(backend: str, rank: int, world_size: int, timeout: datetime.timedelta,
                       device: torch.device | None = None, *, transport: Transport | None = None) -> None:
    """Create the world process group over a key namespace of this start of the job only.

    The store at MASTER_ADDR:MASTER_PORT can outlive a failed attempt (torchrun's agent holds
    it), so the group is built under a prefix the ranks agree on afresh every time
    (`megalite.distributed.rendezvous`): a restarted attempt never reads the dead one's addresses. torch's
    "fake" backend (one simulated rank in this process: collectives return at once and move
    nothing) needs no store. `transport`: what point-to-point transfers go through (default
    torch.distributed's).
    """
    global _NAMESPACE, _TRANSPORT
    kwargs = {"device_id": device} if device is not None else {}
    if backend == "fake":  # torch registers its fake backend and store itself (a public backend name)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    else:
        store = _job_store(rank, world_size, timeout)
        _NAMESPACE = rendezvous.attempt_namespace(store, rank, world_size, timeout.total_seconds())
        dist.init_process_group(backend, store=dist.PrefixStore(_NAMESPACE + "pg/", store), rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    _GROUP_NAMES[dist.group.WORLD] = "world"
    _TRANSPORT = transport or Transport()


def _master_address() -> tuple[str, int]:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise errors.UsageError("MASTER_ADDR and MASTER_PORT are not set: launch with torchrun (or set RANK, "
                                "WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself)")
    return addr, int(port)


def _job_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The job's TCPStore, hosted where torch's env:// init would host it: by torchrun's agent
    when it says so (TORCHELASTIC_USE_AGENT_STORE=True), else by rank 0."""
    addr, port = _master_address()
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0 and not agent_hosts, timeout=timeout,
                         multi_tenant=True)


def destroy_process_group() -> None:
    global _NAMESPACE, _TRANSPORT
    if is_initialized():
        dist.destroy_process_group()
    _GROUP_NAMES.clear()
    _NAMESPACE, _TRANSPORT = None, Transport()


def new_group(ranks: list[int], name: str):
    """Create a process group over `ranks` (every rank must call this for every group)."""
    group = dist.new_group(ranks)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        _GROUP_NAMES[group] = name
    return group


def new_local_group(ranks: list[int], name: str):
    """Create a process group over `ranks` that only its members call (torch's local synchronization:
    the other ranks need not take part; its name is derived from its ranks)."""
    group = dist.new_group(ranks, use_local_synchronization=True)
    _GROUP_NAMES[group] = name
    return group


def side_channel_store(timeout_s: float = 30.0):
    """A new client of the job's store on its own connection, under this attempt's namespace.

    For out-of-band messages while collectives may be hung (the hang watchdog's StoreChannel):
    the process group's own store client may be blocked in a wait. Keys are private to this
    start of the job (see `init_process_group`). None in a single process.
    """
    if not is_initialized() or _NAMESPACE is None:
        return None
    addr, port = _master_address()
    client = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(_NAMESPACE + "side/", client)


def world_group():
    """The group of every process, or None in a single-process run."""
    return dist.group.WORLD if is_initialized() else None


def group_name(group) -> str:
    return "none" if group is None else _GROUP_NAMES.get(group, "unnamed")


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group) -> list[int]:
    """Global ranks of `group`'s members, by group rank (a lookup, no communication)."""
    if group is None:
        return [global_rank()]
    return list(dist.get_process_group_ranks(group))


def global_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def _trivial(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


def _run(op: str, group, tensor: torch.Tensor, nbytes: int, fn, async_op: bool):
    record = ledger.begin(op, group_name(group), tensor, nbytes)
    work = fn()
    if async_op:
        return _TrackedWork(work, record)
    ledger.end(record)
    return None


class _TrackedWork:
    """An async handle whose `wait()` also closes the ring-buffer record."""

    def __init__(self, work, record: OpRecord | None):
        self._work, self._record = work, record

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        if self._record is not None and self._record.end is None:
            ledger.end(self._record)


_DONE = _TrackedWork(None, None)


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of `tensor` over `group`. Returns the tensor (or a handle if async_op)."""
    if _trivial(group):
        return _DONE if async_op else tensor
    work = _run("all_reduce", group, tensor, tensor.numel() * tensor.element_size(),
                lambda: dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op), async_op)
    return work if async_op else tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Gather `input` from every rank into `output` ([n * input.numel()], rank-major)."""
    if _trivial(group):
        output.copy_(input.reshape(output.shape))
        return _DONE if async_op else None
    return _run("all_gather", group, input, output.numel() * output.element_size(),
                lambda: _ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op), async_op)


def all_gather(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (same shape on every rank)."""
    n = group_size(group)
    if n == 1:
        return tensor
    tensor = tensor.contiguous()
    # Backends gather rank-major along dim 0: [n * s0, s1, ...]; other dims are re-cut afterwards.
    output = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    all_gather_into(output, tensor, group)
    if dim % tensor.dim() == 0:
        return output
    return torch.cat(output.chunk(n, dim=0), dim=dim)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group, op: str = "sum",
                        async_op: bool = False):
    """Reduce `input` over `group` and keep this rank's contiguous 1/n piece in `output`."""
    if _trivial(group):
        output.copy_(input.reshape(output.shape))
        return _DONE if async_op else None
    return _run("reduce_scatter", group, input, input.numel() * input.element_size(),
                lambda: _REDUCE_SCATTER_SINGLE(output, input, op=_REDUCE_OPS[op], group=group,
                                               async_op=async_op), async_op)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum `tensor` over `group` and return this rank's slice along `dim` (size must divide)."""
    n = group_size(group)
    if n == 1:
        return tensor
    if tensor.shape[dim] % n != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} is not divisible by {n} ranks")
    out_shape = list(tensor.shape)
    out_shape[dim] //= n
    if dim % tensor.dim() == 0:
        chunks = tensor.contiguous()
    else:  # make each rank's piece contiguous and rank-major along dim 0: [n * s0, ...]
        chunks = torch.cat(tensor.chunk(n, dim=dim), dim=0)
    output = torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
    reduce_scatter_into(output, chunks, group)
    return output


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    """Broadcast `tensor` in place from global rank `src` to every rank of `group`."""
    if _trivial(group):
        return _DONE if async_op else tensor
    work = _run("broadcast", group, tensor, tensor.numel() * tensor.element_size(),
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op)
    return work if async_op else tensor


def broadcast_from_member(tensor: torch.Tensor, member: int, group, async_op: bool = False):
    """Broadcast `tensor` in place from the rank at position `member` of `group`; works on a group built
    outside torch's registry (the replica link, megalite/replicas/replica_link.py). Returns the
    tensor (or a handle if async_op)."""
    if _trivial(group):
        return _DONE if async_op else tensor
    work = _run("broadcast", group, tensor, tensor.numel() * tensor.element_size(),
                lambda: dist.broadcast(tensor, group=group, group_src=member, async_op=async_op), async_op)
    return work if async_op else tensor


def all_to_all(output: torch.Tensor, input: torch.Tensor, group) -> torch.Tensor:
    """Split `input` along dim 0 into n pieces, send piece i to rank i, receive into `output`."""
    if _trivial(group):
        output.copy_(input)
        return output
    _run("all_to_all", group, input, input.numel() * input.element_size(),
         lambda: dist.all_to_all_single(output, input, group=group), False)
    return output


def all_to_all_variable(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                        group) -> torch.Tensor:
    """All-to-all with per-rank counts: rows input_splits[i] of `input` (dim 0, in rank order) go to
    rank i; output_splits[i] rows arrive from rank i (the expert dispatch of mixture of experts)."""
    if _trivial(group):
        output.copy_(input)
        return output
    _run("all_to_all", group, input, input.numel() * input.element_size(),
         lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group), False)
    return output


def barrier(group) -> None:
    if _trivial(group):
        return
    marker = torch.zeros(1)
    _run("barrier", group, marker, 0, lambda: dist.barrier(group=group), False)


def all_gather_object(obj: Any, group) -> list[Any]:
    """Gather a picklable object from every rank of `group` (small metadata only)."""
    if _trivial(group):
        return [obj]
    out: list[Any] = [None] * group_size(group)
    marker = torch.zeros(0)
    _run("all_gather_object", group, marker, 0, lambda: dist.all_gather_object(out, obj, group=group), False)
    return out


def agreed(fn, group):
    """`fn()` on every rank of `group`, with one verdict: if it raises on any rank, every rank raises.

    For checks whose outcome could differ between ranks (files on a node-local disk, a rank
    that cannot read a directory): no rank goes on into a collective that a failed rank will
    never join. One all_gather_object. A failing rank re-raises its own exception; the others
    raise the same UsageError subclass with its message, or a RuntimeError naming the rank.
    """
    try:
        result, outcome = fn(), None
    except Exception as exc:  # noqa: BLE001 - the peers must learn of any failure, or they hang
        result, outcome, own = None, (type(exc), errors.one_line(exc)), exc
    failed = [(rank, o) for rank, o in enumerate(all_gather_object(outcome, group)) if o is not None]
    if not failed:
        return result
    if outcome is not None:
        raise own
    rank, (cls, message) = failed[0]
    if issubclass(cls, errors.UsageError):
        raise cls(message if len({m for _, (_, m) in failed}) == 1 else f"rank {rank}: {message}")
    raise RuntimeError(f"rank {rank} failed: {cls.__name__}: {message}")


# ---------------------------------------------------------------------------------------------
# Point to point
# ---------------------------------------------------------------------------------------------


@dataclass
class P2P:
    """One point-to-point transfer: op is 'send' or 'recv'; peer is a global rank."""

    op: str
    tensor: torch.Tensor
    peer: int


def batch_isend_irecv(transfers: Iterable[P2P], group) -> list[_TrackedWork]:
    """Post all sends and receives together (no ordering deadlock between them); return handles."""
    transfers = list(transfers)
    if not transfers:
        return []
    ops, records = [], []
    for t in transfers:
        if t.op not in ("send", "recv"):
            raise ValueError(f"p2p op must be 'send' or 'recv', got {t.op!r}")
        fn = dist.isend if t.op == "send" else dist.irecv
        ops.append(dist.P2POp(fn, t.tensor, t.peer, group))
        records.append(ledger.begin(t.op, group_name(group), t.tensor, t.tensor.numel() * t.tensor.element_size()))
    works = _TRANSPORT.batch_isend_irecv(ops)
    # torch returns one handle per op on gloo and possibly one for the whole batch on NCCL.
    if len(works) != len(records):
        return [_TrackedWork(w, None) for w in works] + [_TrackedWork(None, r) for r in records]
    return [_TrackedWork(w, r) for w, r in zip(works, records)]


def wait_all(handles: Iterable[_TrackedWork]) -> None:
    for handle in handles:
        handle.wait()
