"""When a bucket's gradients are final, so `GradBuffers` (grad_buffers.py) can start its reduction.

A parameter may receive several deliveries per backward (e.g. a tied weight used through a sink and
through autograd). The first step with a synchronised backward counts the deliveries per parameter
and its reductions launch only in `finish_reduction()`; later steps launch a bucket as soon as its
count is reached. A delivery to a bucket whose reduction already started is an error (the caller's).
Deferred buckets (the tied embedding's) never launch on their count: `finish_reduction()` does.
Pure bookkeeping: no tensors.
"""
from __future__ import annotations

from megalite.data_parallel.layout import BufferLayout


class BucketReadiness:
    """Per-step delivery counts of one buffer layout's parameters and buckets."""

    def __init__(self, layout: BufferLayout, deferred_buckets: set[int]):
        self.layout, self.deferred_buckets = layout, deferred_buckets
        self.expected: list[int] | None = None  # deliveries per param per backward, after calibration
        self.new_step()

    def new_step(self) -> None:
        """Nothing delivered, nothing launched."""
        self.arrived = [0] * len(self.layout.slots)
        self.launched = [False] * len(self.layout.buckets)
        expected = self.expected or [0] * len(self.layout.slots)
        self.remaining = [sum(expected[i] for i in b.params) for b in self.layout.buckets]

    def deliver(self, param_index: int) -> bool:
        """Count one synchronised delivery to `param_index`; True when its bucket is now complete and
        launches on its count (calibrated, not deferred)."""
        bucket = self.layout.slots[param_index].bucket
        self.arrived[param_index] += 1
        if self.expected is None:
            return False
        self.remaining[bucket] -= 1
        return self.remaining[bucket] == 0 and bucket not in self.deferred_buckets

    def end_step(self) -> None:
        """The step's reduction finished: a first synchronised step teaches the counts; then a new step."""
        if self.expected is None and any(self.arrived):  # a step that synchronised no backward teaches nothing
            self.expected = list(self.arrived)
        self.new_step()
