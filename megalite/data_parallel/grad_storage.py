"""Where one model replica's gradients live: fp32 storage per bucket, each parameter's main_grad, the shard.

`GradBuffers` (grad_buffers.py) decides when a bucket is reduced; this class holds the memory:

- zero_stage 0/1: one contiguous fp32 buffer [layout.numel]; each bucket is a slice of it and each
  parameter's main grad (`megalite.parameters.params.main_grad`) a view of its slot, made once.
- zero_stage 2: a bucket's full-size storage exists only from the first gradient it receives in a
  step (`bucket()`) until `free()` after its reduce-scatter; afterwards only the 1/dp shard remains.
- `grad_shard`: this rank's reduced gradients: the whole buffer at zero_stage 0, else its own fp32
  [layout.shard_numel] shard.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megalite.data_parallel.layout import BufferLayout
from megalite.parameters import params as P


class GradStorage:
    """fp32 gradient storage of `params` laid out by `layout` (see the module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: BufferLayout, *, zero_stage: int,
                 device: torch.device):
        self.params, self.layout, self.zero_stage, self.device = list(params), layout, zero_stage, device
        if zero_stage == 2:
            self.buffer = None
            self.buckets: list[torch.Tensor | None] = [None] * len(layout.buckets)
        else:
            self.buffer = torch.zeros(layout.numel, dtype=torch.float32, device=device)
            self.buckets = [self.buffer[b.start:b.end] for b in layout.buckets]
            for p, slot in zip(self.params, layout.slots):
                P.set_main_grad(p, self.buffer[slot.start:slot.end].view(p.shape))
        # The views gradients are added into, made once (zero 0/1: the buffer never moves); a
        # delivery then costs one add_, not a slice and a view as well. ZeRO-2 re-makes them per step.
        self._views: list[torch.Tensor] | None = None if zero_stage == 2 else [P.main_grad(p) for p in self.params]
        if zero_stage == 0:
            self.grad_shard = self.buffer
        else:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)

    def bucket(self, bucket: int) -> torch.Tensor:
        """Bucket `bucket`'s fp32 storage [bucket numel] (ZeRO-2: allocated at its first use in a step)."""
        storage = self.buckets[bucket]
        if storage is None:
            b = self.layout.buckets[bucket]
            storage = torch.zeros(b.numel, dtype=torch.float32, device=self.device)
            self.buckets[bucket] = storage
            for i in b.params:
                slot = self.layout.slots[i]
                P.set_main_grad(self.params[i], storage[slot.start - b.start:slot.end - b.start].view(self.params[i].shape))
        return storage

    def main_grad(self, param_index: int) -> torch.Tensor:
        """The fp32 gradient of `params[param_index]`, shaped as the parameter (allocating it under ZeRO-2)."""
        slot = self.layout.slots[param_index]
        b = self.layout.buckets[slot.bucket]
        storage = self.bucket(slot.bucket)
        return storage[slot.start - b.start:slot.end - b.start].view(self.params[param_index].shape)

    def add(self, param_index: int, grad: torch.Tensor) -> None:
        """Accumulate one delivered gradient into the parameter's main grad."""
        (self._views[param_index] if self._views is not None else self.main_grad(param_index)).add_(grad)

    def free(self, bucket: int) -> None:
        """ZeRO-2: drop bucket `bucket`'s full-size storage (its reduced shard stays in grad_shard)."""
        self.buckets[bucket] = None
        for i in self.layout.buckets[bucket].params:
            P.set_main_grad(self.params[i], None)

    def free_all(self) -> None:
        for bucket in range(len(self.layout.buckets)):
            self.free(bucket)

    def zero(self) -> None:
        """Every gradient zero (ZeRO-2: freed), the shard included."""
        if self.zero_stage == 2:
            self.free_all()
        else:
            self.buffer.zero_()
        if self.zero_stage > 0:
            self.grad_shard.zero_()

    def bytes(self) -> int:
        """Bytes held right now: the full buckets allocated and the shard (when it is not the buffer)."""
        total = sum(t.numel() * t.element_size() for t in self.buckets if t is not None)
        if self.zero_stage > 0:
            total += self.grad_shard.numel() * self.grad_shard.element_size()
        return total
