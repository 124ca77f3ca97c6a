"""Advice from measured step times, printed once per kind when it applies, each naming the fix.

    advisor = Advisor()                                   # print_fn=None on every rank but one
    advisor.observe(step_s=..., pipeline_bubble=..., exposed_dp_comm_s=..., pp=mesh.pp_size)

Two measurements practitioners ask for:
- the pipeline bubble: the idle share of the pipeline, the schedule replayed with every stage's
  measured compute times (`Pipeline.step(..., measure_bubble=True)` -> stats["bubble_fraction"];
  pipeline/replay.py says why not the raw transfer waits, which a busy host inflates). Above 20%:
  more microbatches per step (the 1F1B bubble is (pp-1)/(m+pp-1)) or an interleaved schedule
  (which divides it by about the virtual stages);
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
    return (f"advice: the pipeline bubble is {fraction:.0%} of the step (> {BUBBLE_LIMIT:.0%} at pp={pp}); "
            f"increase microbatches or interleave (a larger global batch or a smaller micro batch; "
            f"--pipeline-schedule interleaved --virtual-stages 2)")


def exposed_dp_advice(fraction: float) -> str:
    return (f"advice: data-parallel communication not hidden by compute took {fraction:.0%} of the step "
            f"(> {EXPOSED_DP_LIMIT:.0%}); use fewer nodes, a larger micro batch, bf16 reduction "
            f"(--grad-reduce-dtype bf16) or PowerSGD (--grad-compression powersgd)")


class Advisor:
    """Accumulates per-step measurements and prints each piece of advice at most once."""

    def __init__(self, print_fn: Callable[[str], object] | None = print, warmup_steps: int = 1):
        self.print_fn, self.warmup_steps = print_fn, warmup_steps
        self.steps = 0
        self.step_s = self.bubble_s = self.exposed_dp_comm_s = 0.0
        self.given: list[str] = []  # the advice printed so far, in order
        self._kinds: set[str] = set()

    def observe(self, step_s: float, pipeline_bubble: float | None = None, exposed_dp_comm_s: float | None = None,
                pp: int = 1, dp: int | None = None) -> list[str]:
        """Record one step: its seconds, its pipeline bubble (a fraction) and its exposed dp
        communication (seconds); pp and dp (the replicas, dp x cp; None: not known) say whether
        either can apply.
        Returns the advice newly given by it (printed via print_fn)."""
        self.steps += 1
        if self.steps <= self.warmup_steps or step_s <= 0.0:
            return []
        self.step_s += step_s
        self.bubble_s += (pipeline_bubble or 0.0) * step_s
        self.exposed_dp_comm_s += exposed_dp_comm_s or 0.0
        new = []
        if pp > 1 and self.bubble_s > BUBBLE_LIMIT * self.step_s:
            new += self._give("bubble", bubble_advice(self.bubble_s / self.step_s, pp))
        if (dp is None or dp > 1) and self.exposed_dp_comm_s > EXPOSED_DP_LIMIT * self.step_s:
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
