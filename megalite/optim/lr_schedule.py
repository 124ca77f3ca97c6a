"""Learning-rate schedules: linear warmup, then cosine (or linear, or constant) decay to min_lr."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    style: str = "cosine"  # "cosine" | "linear" | "constant"

    def __post_init__(self):
        if self.style not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr decay style must be cosine, linear or constant, got {self.style!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}")

    def __call__(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, (step - self.warmup_iters) / span)
        if self.style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor
