"""Advice from measured step times, printed once per kind when it applies, each naming the fix.

    advisor = Advisor()                                   # print_fn=None on every rank but one
    advisor.observe(step_s=..., pipeline_wait_s=..., exposed_dp_comm_s=..., pp=mesh.pp_size)

Two measurements practitioners ask for:
- the pipeline bubble: host seconds a pipeline rank spent in activation/gradient transfers
  (`Pipeline.step(stats=...)["transfer_wait_s"]`, `run_pipeline`'s stats), which is mostly waiting
  for a neighbour stage. Above 20% of the step: more microbatches per step (the 1F1B bubble is
  (pp-1)/(m+pp-1) of it) or an interleaved schedule (which divides it by the virtual stages);
- exposed data-parallel communication: host seconds blocked on dp reductions and gathers that
  compute did not hide (`DataParallel.exposed_comm_seconds()`). Above 20% of the step: fewer
  nodes (or more of the reduction inside one), a larger micro batch (more compute per reduction),
  bf16 gradient reduction (half the bytes) or PowerSGD (low-rank factors).

The first `warmup_steps` steps are not judged (one-time costs: allocation, first gathers); after
them the fraction is of the seconds summed since, so one noisy step does not fire the advice.
"""
from __future__ import annotations

from typing import Callable

BUBBLE_LIMIT = 0.20
EXPOSED_DP_LIMIT = 0.20


def bubble_advice(fraction: float, pp: int) -> str:
    return (f"advice: the pipeline waited {fraction:.0%} of the step (bubble > {BUBBLE_LIMIT:.0%} at pp={pp}); "
            f"increase microbatches (a larger global batch or a smaller micro batch) or interleave "
            f"(--schedule interleaved --virtual-stages 2)")


def exposed_dp_advice(fraction: float) -> str:
    return (f"advice: data-parallel communication not hidden by compute took {fraction:.0%} of the step "
            f"(> {EXPOSED_DP_LIMIT:.0%}); use fewer nodes, a larger micro batch, bf16 reduction "
            f"(--grad-reduce-dtype bf16) or PowerSGD (--grad-compression powersgd)")


class Advisor:
    """Accumulates per-step measurements and prints each piece of advice at most once."""

    def __init__(self, print_fn: Callable[[str], object] | None = print, warmup_steps: int = 1):
        self.print_fn, self.warmup_steps = print_fn, warmup_steps
        self.steps = 0
        self.step_s = self.pipeline_wait_s = self.exposed_dp_comm_s = 0.0
        self.given: list[str] = []  # the advice printed so far, in order
        self._kinds: set[str] = set()

    def observe(self, step_s: float, pipeline_wait_s: float | None = None, exposed_dp_comm_s: float | None = None,
                pp: int = 1) -> list[str]:
        """Record one step (seconds); returns the advice newly given by it (printed via print_fn)."""
        self.steps += 1
        if self.steps <= self.warmup_steps or step_s <= 0.0:
            return []
        self.step_s += step_s
        self.pipeline_wait_s += pipeline_wait_s or 0.0
        self.exposed_dp_comm_s += exposed_dp_comm_s or 0.0
        new = []
        if pp > 1 and self.pipeline_wait_s > BUBBLE_LIMIT * self.step_s:
            new += self._give("bubble", bubble_advice(self.pipeline_wait_s / self.step_s, pp))
        if self.exposed_dp_comm_s > EXPOSED_DP_LIMIT * self.step_s:
            new += self._give("dp", exposed_dp_advice(self.exposed_dp_comm_s / self.step_s))
        return new

    def _give(self, kind: str, text: str) -> list[str]:
        if kind in self._kinds:
            return []
        self._kinds.add(kind)
        self.given.append(text)
        if self.print_fn is not None:
            self.print_fn(text)
        return [text]
