"""An optimizer state indexed like the shard but stored only where some parameters need it.

With Muon, AdamW's second moment exists for AdamW's elements only (embeddings, output layer, norms,
biases, router): Muon keeps one buffer, its momentum, in exp_avg's place. `CompactState` stores
[sum of run lengths] fp32 elements and answers shard slices as the shard-sized tensor would:

    state[a:b]   inside one run: a view of the storage (reads and writes land there);
                 outside every run: fresh zeros (nothing is kept there: writes are dropped);
                 across a run's edge: an error (a piece belongs to one parameter, hence one kind).
"""
from __future__ import annotations

import bisect

import torch


class CompactState:
    """fp32 storage for the shard ranges `runs` (sorted, disjoint [start, end)), indexed in shard coordinates."""

    def __init__(self, runs: list[tuple[int, int]], *, device: torch.device, pin: bool = False):
        self.runs = runs
        self.starts = [a for a, _ in runs]
        self.offsets, total = [], 0
        for a, b in runs:
            self.offsets.append(total)
            total += b - a
        data = torch.zeros(total, dtype=torch.float32, device=device)
        self.data = data.pin_memory() if pin else data
        self.dtype, self.device = self.data.dtype, self.data.device

    def __getitem__(self, index: slice) -> torch.Tensor:
        a, b = index.start, index.stop
        run = bisect.bisect_right(self.starts, a) - 1
        if run >= 0 and b <= self.runs[run][1]:
            lo = self.offsets[run] + a - self.runs[run][0]
            return self.data[lo:lo + b - a]
        after = run + 1
        if (run < 0 or a >= self.runs[run][1]) and (after == len(self.runs) or b <= self.runs[after][0]):
            return torch.zeros(b - a, dtype=self.dtype, device=self.device)
        raise IndexError(f"shard range [{a}, {b}) crosses the edge of a stored run")

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return self.data.element_size()

    def any(self) -> bool:
        return bool(self.data.any())


def merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted runs with touching ones joined."""
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
