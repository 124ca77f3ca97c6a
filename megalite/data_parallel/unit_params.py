"""ZeRO-3 parameters: this rank's 1/dp shard of every unit; a unit's full parameters only while gathered.

Storage on each rank (p = bytes per element of the training dtype, Ψ = parameters of this
rank's replica, i.e. its tp shards of its pipeline stage):

- `shard` [layout.shard_numel], float32 whatever the training dtype: chunk `shard_rank` of
  every unit, unit after unit (`layout.build_unit_layout`): 4·Ψ/dp bytes plus padding (< dp
  elements per unit). It IS the optimizer's fp32 master, updated in place; with bf16/fp16
  training each gather casts this rank's chunk to the training dtype first (as FSDP2 does),
  so there is no second copy of the parameters at all.
- `full[u]` [unit u's padded numel]: the unit's full parameters, every parameter a view of it.
  While the unit is not gathered its storage is resized to 0 bytes; gathering resizes it back
  and all-gathers the shards into it. Everything holding a view (the parameters themselves,
  and the tensors autograd saved for backward) therefore sees the gathered values again after
  a re-gather and holds no memory in between (the storage-resize idea of FSDP).

Gathers are reference counted: `acquire(u)` starts unit u's all-gather unless it is already
gathered (or in flight), `wait(u)` completes it, `release(u)` frees the full parameters when
the last holder lets go. The scheduling (who holds what when) is `zero3.py`'s.

A model built on the meta device (no memory) is materialised here one unit at a time: the
unit's `materialize()` builds its tensors from the model's seeded stream, this rank copies
its chunk into the shard and drops them, so no rank ever holds more than one unit in full.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.data_parallel.layout import BufferLayout
from megalite.data_parallel.units import Unit
from megalite.fp8.param_gather import unit_gathers


class UnitParams:
    """Sharded parameter storage and reference-counted unit gathers (see the module docstring)."""

    overlap = False  # nothing is left in flight after the optimizer step: it updates the shard only

    def __init__(self, units: Sequence[Unit], layout: BufferLayout, dp_group, shard_rank: int, device,
                 groups: tuple = (), shard_ranks: tuple[int, ...] = (), fp8_param_gather: bool = False):
        params = [p for unit in units for p in unit.params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO-3 needs every parameter in one dtype, got {sorted(map(str, dtypes))}; cast the "
                             f"model (e.g. model.to(torch.bfloat16)) before wrapping it")
        self.layout, self.dp_group, self.shard_rank = layout, dp_group, shard_rank
        # by unit kind (0 dense, 1 experts): the group a unit gathers over and this rank's chunk of it
        self.groups, self.shard_ranks = groups or (dp_group,), shard_ranks or (shard_rank,)
        self.dtype, self.device = params[0].dtype, torch.device(device)  # the training dtype (full params)
        shard_dtype = torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else self.dtype
        self.shard = torch.zeros(layout.shard_numel, dtype=shard_dtype, device=self.device)
        self.full: list[torch.Tensor] = []
        self.replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> the real parameter standing for it
        for bucket, unit in zip(layout.buckets, units):
            self._fill_shard(bucket.index, unit)
            full = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            unit.params = [self._point_into(p, full, layout.slots[i], bucket.start)
                           for p, i in zip(unit.params, bucket.params)]
            full.untyped_storage().resize_(0)  # views are made while it has memory; now it has none
            self.full.append(full)
        self.params = [p for unit in units for p in unit.params]
        # --fp8-param-gather: units holding FP8 layers' weights send those in FP8 (megalite.fp8.param_gather)
        self.fp8_gathers = unit_gathers(units, layout, self.shard_ranks, self.dtype, self.device) \
            if fp8_param_gather else [None] * len(units)
        self.exact_gathers = False  # set around `DataParallel.gathered()`: no FP8 on the wire then
        self.holds = [0] * len(layout.buckets)
        self.pending: dict[int, object] = {}  # unit -> all-gather handle in flight
        self._gathered = [False] * len(layout.buckets)
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.gathers = 0  # all-gathers started (for tests and metrics)
        self.wait_seconds = 0.0  # host seconds blocked waiting for gathers (the exposed part)

    # ------------------------------------------------------------------ construction

    @torch.no_grad()
    def _fill_shard(self, bucket: int, unit: Unit) -> None:
        """Copy this rank's chunk of unit `bucket` into the shard (materialising it when on meta)."""
        on_meta = any(p.is_meta for p in unit.params)
        if on_meta and unit.materialize is None:
            raise ValueError(f"unit {unit.name!r} has parameters on the meta device and no materialize(); build the "
                             f"model on a real device or give the unit a materialize callback")
        tensors = unit.materialize() if on_meta else [p.detach() for p in unit.params]
        if [tuple(t.shape) for t in tensors] != [tuple(p.shape) for p in unit.params]:
            raise ValueError(f"unit {unit.name!r}: materialize() returned shapes {[tuple(t.shape) for t in tensors]}, "
                             f"the parameters have {[tuple(p.shape) for p in unit.params]}")
        b = self.layout.buckets[bucket]
        own_start, own_end = b.owned(self.shard_ranks[b.kind])
        for tensor, index in zip(tensors, b.params):
            slot = self.layout.slots[index]
            lo, hi = max(slot.start, own_start), min(slot.end, own_end)
            if lo < hi:
                target = self.shard[b.shard_offset + lo - own_start:b.shard_offset + hi - own_start]
                target.copy_(tensor.reshape(-1)[lo - slot.start:hi - slot.start])

    def _point_into(self, param: nn.Parameter, full: torch.Tensor, slot, bucket_start: int) -> nn.Parameter:
        """Make `param` a view of the unit's full buffer (a meta parameter is replaced by a real one)."""
        if param.is_meta:
            real = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=param.requires_grad)
            P.copy_info(param, real)
            self.replaced[id(param)] = real
            shape, param = param.shape, real
        else:
            shape = param.shape
        param.data = full[slot.start - bucket_start:slot.end - bucket_start].view(shape)
        return param

    # ------------------------------------------------------------------ gathers

    def acquire(self, unit: int) -> None:
        """One more holder of unit `unit`'s full parameters; starts its all-gather if needed."""
        self.holds[unit] += 1
        if self._gathered[unit]:
            return
        full = self.full[unit]
        nbytes = full.numel() * full.element_size()
        full.untyped_storage().resize_(nbytes)
        self._gathered[unit] = True
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self.gathers += 1
        self.pending[unit] = self._start_gather(unit)

    def _start_gather(self, unit: int) -> tuple:
        """(handle, what must live until the wait, what completes the gather after it or None)."""
        send = self.owned_chunk(unit).to(self.dtype)  # the training dtype on the wire; kept until the wait
        group, full, fp8 = self.groups[self.layout.buckets[unit].kind], self.full[unit], self.fp8_gathers[unit]
        if fp8 is None or self.exact_gathers:
            return comm.all_gather_into(full, send, group, async_op=True), send, None
        scales = fp8.scales(send, group)  # [FP8 weights of the unit], all-reduced now (small, blocking)
        wire = fp8.pack(send, scales)  # [K + O*esize] uint8
        gathered = torch.empty(fp8.n * fp8.wire_bytes, dtype=torch.uint8, device=self.device)
        return (comm.all_gather_into(gathered, wire, group, async_op=True), wire,
                lambda: fp8.unpack(gathered, scales, full))

    def wait(self, unit: int) -> None:
        """Complete unit `unit`'s all-gather if it is still in flight."""
        pending = self.pending.pop(unit, None)
        if pending is not None:
            started = time.perf_counter()
            pending[0].wait()
            if pending[2] is not None:
                pending[2]()  # FP8 gather: dequantise into the full buffer
            self.wait_seconds += time.perf_counter() - started

    def release(self, unit: int) -> None:
        """One holder fewer; the last one frees the full parameters (the storage, not the views)."""
        if self.holds[unit] <= 0:
            raise RuntimeError(f"unit {unit} released more often than acquired")
        self.holds[unit] -= 1
        if self.holds[unit] == 0:
            self.wait(unit)  # never free memory a gather is still writing
            full = self.full[unit]
            full.untyped_storage().resize_(0)
            if self.fp8_gathers[unit] is not None:
                self.fp8_gathers[unit].forget()
            self._gathered[unit] = False
            self.gathered_bytes -= full.numel() * full.element_size()

    def is_gathered(self, unit: int) -> bool:
        return self._gathered[unit]

    # ------------------------------------------------------------------ the optimizer's side

    def owned_chunk(self, unit: int) -> torch.Tensor:
        """This rank's chunk of unit `unit` in the shard (fp32 for bf16/fp16 training, [chunk_numel])."""
        b = self.layout.buckets[unit]
        return self.shard[b.shard_offset:b.shard_offset + b.chunk_numel]

    @torch.no_grad()
    def publish(self, unit: int, chunk: torch.Tensor) -> None:
        """Write this rank's updated chunk (any dtype/device); nothing is gathered after a step."""
        owned = self.owned_chunk(unit)
        if chunk.data_ptr() != owned.data_ptr() or chunk.device != owned.device:
            owned.copy_(chunk, non_blocking=True)
        if self._gathered[unit]:  # held across the step (e.g. a user's summon): refresh it
            self.wait(unit)
            self.pending[unit] = self._start_gather(unit)
            self.wait(unit)

    def published(self) -> None:
        pass

    def nbytes(self) -> int:
        """Parameter bytes held now: the shard and every unit currently gathered."""
        return self.shard.numel() * self.shard.element_size() + self.gathered_bytes
