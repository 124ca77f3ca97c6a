"""The model's parameters as views of one contiguous buffer, and the all-gathers that refill it.

The buffer has the gradients' layout (`layout.BufferLayout`: reverse order of use, buckets
padded to a multiple of the shard count). A sharded optimizer updates its chunk of every
bucket in fp32 and hands it back (`publish`): the chunk is cast into this rank's slot of the
buffer and the bucket is all-gathered over dp, so every rank's view of every parameter is
current again. Bucket b's gather runs while bucket b+1 is updated.

With `overlap=True` the gathers are left running when the step ends (Megatron's
--overlap-param-gather): they complete behind the next forward. `ReadGuard` makes that safe
whatever path reads a parameter: while any gather is in flight, every torch function, tensor
method or attribute read (a layer's call, `weight.t()`, `F.embedding(ids, table)`, `.data`,
the `data_ptr()` a Triton launch takes) whose tensor arguments overlap memory of a bucket
still being gathered first waits for that bucket. Views and aliases are caught too: the test
is on the memory range, not on the object.
"""
from __future__ import annotations

import bisect
import time
from typing import Iterable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from megalite.distributed import comm
from megalite.data_parallel.layout import BufferLayout


class ParamBuffer:
    """Contiguous storage of one replica's parameters (`params` in buffer order) over `dp_group`.

    shard_rank: the chunk of every bucket this rank's optimizer updates (0 when not sharded:
    then publishing is a local copy). Creating it re-points each `param.data` to its view.
    Layouts with expert buckets (kind 1) pass `groups` and `shard_ranks` by kind: those buckets
    gather over the expert-data-parallel group.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: BufferLayout, dp_group, shard_rank: int,
                 overlap: bool = False, groups: tuple = (), shard_ranks: tuple[int, ...] = ()):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"data parallelism needs every parameter in one dtype, got {sorted(map(str, dtypes))}; "
                             f"cast the model (e.g. model.to(torch.bfloat16)) before wrapping it")
        self.layout, self.dp_group, self.shard_rank, self.overlap = layout, dp_group, shard_rank, overlap
        self.groups, self.shard_ranks = groups or (dp_group,), shard_ranks or (shard_rank,)  # by bucket kind
        self.dtype, self.device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        for p, slot in zip(params, layout.slots):
            view = self.buffer[slot.start:slot.end]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(p.shape)
        self._bucket_starts = [b.start for b in layout.buckets]
        self.pending: dict[int, object] = {}  # bucket index -> all-gather handle still in flight
        self.wait_seconds = 0.0  # host seconds ever blocked waiting for gathers (the exposed part)

    def owned_chunk(self, bucket: int) -> torch.Tensor:
        """This rank's slot of `bucket` in the buffer (param dtype, [chunk_numel])."""
        b = self.layout.buckets[bucket]
        start, end = b.owned(self.shard_ranks[b.kind])
        return self.buffer[start:end]

    def publish(self, bucket: int, chunk: torch.Tensor) -> None:
        """Write this rank's updated chunk of `bucket` (any dtype/device) into its slot and start the
        bucket's all-gather, in place (the slot is the gather's input). A chunk that IS the slot
        (fp32 training: the optimizer's master is the buffer itself) is not copied."""
        b = self.layout.buckets[bucket]
        out = self.buffer[b.start:b.end]  # [bucket numel] = every rank's chunk, rank-major
        owned = self.owned_chunk(bucket)
        if chunk.data_ptr() != owned.data_ptr() or chunk.device != owned.device:
            owned.copy_(chunk, non_blocking=True)
        if b.shard_count == 1:
            return
        self.pending[bucket] = comm.all_gather_into(out, owned, self.groups[b.kind], async_op=True)

    def published(self) -> None:
        """The step has handed over every bucket: wait now, unless the gathers overlap the next forward."""
        if not self.overlap:
            self.wait()

    def nbytes(self) -> int:
        """Parameter bytes held: the whole buffer (every rank keeps every parameter below ZeRO-3)."""
        return self.buffer.numel() * self.buffer.element_size()

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        """Complete the all-gathers still in flight (of `buckets`, default all)."""
        if not self.pending:
            return
        indices = list(self.pending) if buckets is None else [b for b in buckets if b in self.pending]
        started = time.perf_counter()
        for index in indices:
            self.pending.pop(index).wait()
        self.wait_seconds += time.perf_counter() - started

    def buckets_touched(self, tensor: torch.Tensor) -> range:
        """Buckets whose memory `tensor` (a view of anything) overlaps; empty when outside the buffer."""
        esize = self.buffer.element_size()
        try:
            offset = tensor.data_ptr() - self.buffer.data_ptr()
        except RuntimeError:  # no storage (e.g. a meta or sparse tensor): cannot alias the buffer
            return range(0)
        if tensor.numel() == 0 or offset < 0 or offset >= self.buffer.numel() * esize:
            return range(0)
        first = offset // esize
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
        lo = bisect.bisect_right(self._bucket_starts, first) - 1
        hi = bisect.bisect_right(self._bucket_starts, first + extent - 1)
        return range(lo, hi)

    def wait_for_reads(self, args: tuple, kwargs: dict) -> None:
        """Wait for every pending bucket that a tensor among `args`/`kwargs` (one level deep) overlaps."""
        for value in (*args, *kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor) and self.pending:
                    touched = [b for b in self.buckets_touched(item) if b in self.pending]
                    if touched:
                        self.wait(touched)


class ReadGuard(TorchFunctionMode):
    """Active during a model chunk's forward while gathers are in flight (see the module docstring)."""

    def __init__(self, params: ParamBuffer):
        super().__init__()
        self.params = params

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.params.pending:  # inside this handler the mode is off: these calls do not recurse
            self.params.wait_for_reads(args, kwargs)
        return func(*args, **kwargs)
