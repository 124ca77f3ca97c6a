"""Learning-rate schedules: linear warmup, then cosine (or linear, or constant) decay to min_lr, or
warmup-stable-decay (WSD: the peak held until the last `wsd_decay_iters` decay steps, which anneal to
min_lr by `wsd_style`, as Megatron-LM's --lr-decay-style WSD); and the same schedule as a torch LR
scheduler driving an optimizer's param groups (`ScheduledLR`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite.config.choices import LRDecay


# WSD's anneal: the share of (lr - min_lr) left at `ratio` of the anneal (1 at its start, 0 at its end)
WSD_ANNEALS = {
    "exponential": lambda ratio: 2.0 * 0.5 ** ratio - 1.0,
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0),
    "minus_sqrt": lambda ratio: 1.0 - math.sqrt(ratio),
}


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int = 1
    style: str = "cosine"  # "cosine" | "linear" | "constant" | "WSD"
    wsd_decay_iters: int = 0  # WSD: the final steps of the decay span that anneal (before them: the peak)
    wsd_style: str = "exponential"  # WSD's anneal: "exponential" | "linear" | "cosine" | "minus_sqrt"

    def __post_init__(self):
        if self.style not in tuple(LRDecay):
            raise ValueError(f"lr decay style must be cosine, linear, constant or WSD, got {self.style!r}")
        if self.style == LRDecay.WSD and self.wsd_style not in WSD_ANNEALS:
            raise ValueError(f"WSD's decay style must be one of {sorted(WSD_ANNEALS)}, got {self.wsd_style!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}")

    def __call__(self, step: float) -> float:
        """Learning rate for optimizer step `step` (0-based). A fractional `step` (full global batches
        consumed, under --rampup-batch-size) lies between its neighbours; the warm-up stops at lr."""
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.lr * min(step + 1, self.warmup_iters) / self.warmup_iters
        if self.style == LRDecay.CONSTANT:
            return self.lr
        if self.style == LRDecay.WSD:  # stable at the peak, then the last wsd_decay_iters steps anneal
            anneal = max(1, self.wsd_decay_iters)
            start = self.decay_iters - anneal
            if step < start:
                return self.lr
            ratio = min(1.0, (step - start) / anneal)
            return self.min_lr + (self.lr - self.min_lr) * WSD_ANNEALS[self.wsd_style](ratio)
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, (step - self.warmup_iters) / span)
        if self.style == LRDecay.LINEAR:
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor


class ScheduledLR(torch.optim.lr_scheduler.LRScheduler):
    """An `LRSchedule` as a torch LR scheduler: after `step()` number k (0-based) of the scheduler, each
    group's lr is schedule(k) (times the group's initial lr / schedule.lr, for groups given their own lr).

        scheduler = ScheduledLR(optimizer, LRSchedule(3e-4, 3e-5, 100, 10_000))
        for step in range(...): ...; optimizer.step(); scheduler.step()

    `jump_to(k)` sets the lr of optimizer step k directly (a resumed run starts there).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule, last_epoch: int = -1):
        self.schedule = schedule
        super().__init__(optimizer, last_epoch)

    def _at(self, step: int) -> list[float]:
        lr = self.schedule(step)
        # a group at the schedule's own lr gets its value exactly (x * a / a is not always x in floating point)
        return [lr if group["initial_lr"] == self.schedule.lr else lr * group["initial_lr"] / self.schedule.lr
                for group in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self._at(max(self.last_epoch, 0))

    def jump_to(self, step: int) -> None:
        self.last_epoch = step
        for group, lr in zip(self.optimizer.param_groups, self._at(step)):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
