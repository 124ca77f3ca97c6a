"""ZeRO-3 gradients: a unit's full fp32 gradient only while its backward runs, then its 1/dp shard.

- Gradients arrive as in `grad_buffers.py` (megalite's linears hand them to a sink, other
  parameters' `.grad` is moved by a post-accumulate-grad hook) and are added into the unit's
  full fp32 storage [unit numel], allocated at the unit's first gradient.
- `reduce(u)` (called by the schedule when unit u's backward is done) sums the
  sequence-parallel parameters' partial gradients over tp, then starts an asynchronous
  reduce-scatter over dp in `grad_reduce_dtype` and detaches the storage: a gradient that
  arrives later (another microbatch) starts a fresh one. When the reduce-scatter completes,
  its [chunk] result is ADDED into `grad_shard` (fp32), which therefore accumulates the
  microbatches of a step. Every delivered gradient is reduced exactly once, whenever
  `reduce` runs: the sum is linear, so timing changes traffic, never the result.
- Reduction is once per microbatch, not once per step: keeping every unit's full gradient
  until the step's last microbatch would hold 4Ψ bytes, ZeRO-1's gradient memory, which is
  what ZeRO-3 exists to avoid. At most `max_in_flight` reductions are pending at a time, so
  full-size gradients never pile up.
- Hybrid sharding (`replicate_group`): the reduce-scatters run within the shard group; the
  step's accumulated shard is all-reduced over the replicas once, in `finish_reduction()`
  (per microbatch would send the same bytes m times).
- Units holding a parameter tied across pipeline stages (one per stage, same layout) sum
  their gradient SHARD over the embedding group in `finish_reduction()`: 1/dp of ZeRO-1's bytes.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.data_parallel.grad_buffers import FORGOT_ZERO_GRAD
from megalite.data_parallel.layout import BufferLayout


class UnitGrads:
    """fp32 gradients of ZeRO-3 units and their per-microbatch reduce-scatter (see the module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: BufferLayout, dp_group, *,
                 grad_reduce_dtype: torch.dtype = torch.float32, tp_group=None, embedding_group=None,
                 max_in_flight: int = 1, groups: tuple = (), replicate_group=None):
        if grad_reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad_reduce_dtype must be torch.float32 or torch.bfloat16, got {grad_reduce_dtype}")
        self.params, self.layout = list(params), layout
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.grad_reduce_dtype, self.max_in_flight = grad_reduce_dtype, max_in_flight
        self.device = self.params[0].device
        # hybrid sharding: the ranks holding this rank's shard of every unit (dense and expert alike)
        self.replicate_group = replicate_group if comm.group_size(replicate_group) > 1 else None
        self.replica_link = None  # --ft-replica-groups: the replicas' sum over the link (replicas/trainer.py)
        self.shard_rank = comm.group_rank(dp_group)
        self.groups = groups or (dp_group,)  # by unit kind: dense units over dp x cp, expert units over expert-dp
        self.shard_ranks = tuple(comm.group_rank(g) for g in self.groups)
        self._finished = False  # finish_reduction() ran and no gradient arrived since
        self._stale = False  # finish_reduction() ran and zero_grad() did not since
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=self.device)
        self._storage: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._unit_of = [slot.bucket for slot in layout.slots]
        self._sp_params = [[i for i in b.params if P.is_sequence_parallel_grad(self.params[i])]
                           for b in layout.buckets]
        self.tied_units = sorted({self._unit_of[i] for i, p in enumerate(self.params)
                                  if embedding_group is not None and P.is_tied_across_stages(p)})
        self._pending: collections.deque = collections.deque()  # (unit, handle, send, out)
        self.reductions = 0  # reduce-scatters started (for tests and metrics)
        self.exposed_seconds = 0.0
        self._hooks = []
        for index, p in enumerate(self.params):
            P.set_grad_destination(p, self._make_sink(index), None)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))

    # ------------------------------------------------------------------ accumulation

    def _make_sink(self, index: int):
        def sink(param: torch.Tensor, grad: torch.Tensor) -> None:
            if self._stale:
                raise RuntimeError(FORGOT_ZERO_GRAD)
            self.main_grad(index).add_(grad)
        return sink

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            grad, param.grad = param.grad, None  # the fp32 storage is the only copy
            if self._stale:
                raise RuntimeError(FORGOT_ZERO_GRAD)
            self.main_grad(index).add_(grad)
        return hook

    def main_grad(self, index: int) -> torch.Tensor:
        """The fp32 gradient view of `self.params[index]` (allocating its unit's storage)."""
        unit = self._unit_of[index]
        b, slot = self.layout.buckets[unit], self.layout.slots[index]
        self._finished = False
        storage = self._storage[unit]
        if storage is None:
            storage = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            self._storage[unit] = storage
            for i in b.params:
                s = self.layout.slots[i]
                P.set_main_grad(self.params[i], storage[s.start - b.start:s.end - b.start].view(self.params[i].shape))
        return storage[slot.start - b.start:slot.end - b.start].view(self.params[index].shape)

    def has_gradient(self, unit: int) -> bool:
        return self._storage[unit] is not None

    # ------------------------------------------------------------------ reduction

    def reduce(self, unit: int) -> None:
        """Start the reduce-scatter of whatever gradient unit `unit` holds (nothing if none)."""
        storage = self._storage[unit]
        if storage is None:
            return
        b = self.layout.buckets[unit]
        self._storage[unit] = None
        for i in b.params:
            P.set_main_grad(self.params[i], None)
        sp = self._sp_params[unit]
        if sp and comm.group_size(self.tp_group) > 1:  # partial sums per tp rank (sequence parallelism)
            pieces = [storage[self.layout.slots[i].start - b.start:self.layout.slots[i].end - b.start] for i in sp]
            flat = torch.cat(pieces)
            comm.all_reduce(flat, self.tp_group)
            offset = 0
            for piece in pieces:
                piece.copy_(flat[offset:offset + piece.numel()])
                offset += piece.numel()
        send = storage if self.grad_reduce_dtype == torch.float32 else storage.to(self.grad_reduce_dtype)
        out = torch.empty(b.chunk_numel, dtype=send.dtype, device=self.device)
        while len(self._pending) >= self.max_in_flight:
            self._complete(self._pending.popleft())
        handle = comm.reduce_scatter_into(out, send, self.groups[b.kind], async_op=True)
        self._pending.append((unit, handle, send, out))
        self.reductions += 1

    def _complete(self, entry) -> None:
        unit, handle, _send, out = entry
        handle.wait()
        b = self.layout.buckets[unit]
        self.grad_shard[b.shard_offset:b.shard_offset + b.chunk_numel].add_(out)

    def reduce_all(self, units: Sequence[int] | None = None) -> None:
        for unit in range(len(self.layout.buckets)) if units is None else units:
            self.reduce(unit)

    def finish_reduction(self) -> None:
        """Reduce every gradient still held, complete all reductions, sum tied units over the
        embedding group. Afterwards `grad_shard` holds this rank's summed gradients."""
        started = time.perf_counter()
        self.reduce_all()
        while self._pending:
            self._complete(self._pending.popleft())
        if self.replicate_group is not None:  # hybrid sharding: the step's shard summed over the replicas, once
            comm.all_reduce(self.grad_shard, self.replicate_group)
        for unit in self.tied_units:
            b = self.layout.buckets[unit]
            comm.all_reduce(self.grad_shard[b.shard_offset:b.shard_offset + b.chunk_numel], self.embedding_group)
        if self.replica_link is not None:  # --ft-replica-groups: the shard summed over the live groups, one collective
            self.replica_link.reduce(self.grad_shard)
        self.exposed_seconds = time.perf_counter() - started
        self._finished = True
        self._stale = True  # the next step's backward must start from zero_grad() (grad_buffers.py)

    def reduction_pending(self) -> bool:
        """False once finish_reduction() has run and no gradient arrived since."""
        return not self._finished

    def zero_grad(self) -> None:
        if self._pending:
            raise RuntimeError("zero_grad() while dp reductions are in flight; call finish_reduction() first")
        self.grad_shard.zero_()
        self._finished = False
        self._stale = False
        for unit in range(len(self._storage)):
            self._storage[unit] = None
        for p in self.params:
            p.grad = None
            P.set_main_grad(p, None)

    # ------------------------------------------------------------------ metrics

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now: the fp32 shard, full unit gradients, sends in flight."""
        total = self.grad_shard.numel() * 4 + sum(s.numel() * 4 for s in self._storage if s is not None)
        return total + sum(send.numel() * send.element_size() for _, _, send, _ in self._pending)

    def remove_hooks(self) -> None:
        P.detach_grad_destinations(self.params, self._hooks)
