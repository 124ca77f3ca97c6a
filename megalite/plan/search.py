"""suggest()'s search over the layouts of N GPUs, pruned by bounds that never drop one it prints.

The exhaustive search estimated every candidate's memory over all its pipeline stages and
predicted the step time of every candidate that fits: for the 1T-parameter row of Narayanan et
al. 2021 at 3,072 GPUs (pp up to 128, interleaving, ZeRO, recompute, micro batches) that was
minutes. The pruned search prints the same thing (tests/plan/test_search.py compares the two):

1. Memory, stage by stage. A layout fits when every stage's device bytes fit (the estimate's total
   is its largest stage's), so the check stops at the first stage that does not, stage 0 first (it
   holds the most microbatches in flight, and the embedding), then the last (the head).
2. A lower bound of the step time for each layout that fits (`timing.step_time_lower_bound`: the
   last stage's exposed time, at about 1/pp of a prediction's cost). The layouts are predicted in
   increasing order of that bound, and the search stops at the first whose bound exceeds both the
   k-th best time predicted so far (by more than the ranking's rounding to 0.1 ms can hide) and the
   best time x (1 + near_best). That layout, and every one after it, is slower than k predicted
   layouts and not within near_best of the best: it would rank below k others (ranking._rank: the
   near-best first, then by time), and leaves the best, the near-best set and the order of the
   others as they are, so the first k are the exhaustive search's first k.
3. What is kept goes back in the order the candidates were generated, so ties rank as before.

`exhaustive=True` runs the unpruned search (the tests' oracle).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterable

from megalite.config.model import GPTConfig
from megalite.plan.hardware import HardwareProfile
from megalite.plan.per_rank import Estimate, estimate, fits_memory, stage_total_bytes
from megalite.plan.timing import predict_step_time, step_time_lower_bound
from megalite.plan.validity import preflight

if TYPE_CHECKING:
    from megalite.config import RunConfig

# round(t, 4) in the ranking's key: times further apart than this never round to the same key
ROUNDING_MARGIN_S = 2e-4


def fits(model: GPTConfig, cfg: RunConfig, gpu_memory: float) -> bool:
    """estimate(model, cfg).fits(gpu_memory), stopping at the first stage that does not fit."""
    pp = cfg.parallel.pp
    order = [0] + ([pp - 1] if pp > 1 else []) + list(range(1, pp - 1))
    return all(fits_memory(stage_total_bytes(model, cfg, stage), gpu_memory) for stage in order)


def search(model: GPTConfig, candidates: Iterable[RunConfig], gpus: int, gpu_memory: float, gpus_per_node: int,
           hardware: HardwareProfile, top_k: int, near_best: float,
           exhaustive: bool = False) -> list[tuple[RunConfig, Estimate, dict]]:
    """(cfg, estimate, step-time parts) of the valid candidates that fit `gpu_memory` and may rank
    in the first `top_k` (all of them with `exhaustive`), in the candidates' order."""
    fitting = []  # (lower bound, index, cfg)
    for index, cfg in enumerate(candidates):
        if preflight(model, cfg, gpus):
            continue
        if exhaustive:
            fitting.append((0.0, index, cfg))
        elif fits(model, cfg, gpu_memory):
            fitting.append((step_time_lower_bound(model, cfg, hardware, gpus_per_node), index, cfg))
    if not exhaustive:
        fitting.sort(key=lambda item: (item[0], item[1]))
    kept, fastest = [], []  # fastest: a max-heap (negated) of the top_k smallest predicted times
    for bound, index, cfg in fitting:
        if not exhaustive and fastest and len(fastest) >= top_k and \
                bound > _cutoff(-fastest[0], -max(fastest), near_best):
            break  # this bound and every later one: not in the first top_k (module docstring, 2)
        est = estimate(model, cfg)
        if exhaustive and not est.fits(gpu_memory):
            continue
        parts = predict_step_time(model, cfg, hardware, ranks_per_node=gpus_per_node).breakdown()
        kept.append((index, cfg, est, parts))
        heapq.heappush(fastest, -parts["total"])
        if len(fastest) > top_k:
            heapq.heappop(fastest)
    return [(cfg, est, parts) for _, cfg, est, parts in sorted(kept, key=lambda item: item[0])]


def _cutoff(kth: float, best: float, near_best: float) -> float:
    """Seconds above which a layout can no longer reach the first k: past the k-th best time `kth`
    (by more than rounding can hide) and outside near_best of the best time `best` so far."""
    return max(kth + ROUNDING_MARGIN_S + 1e-9 * kth, best * (1 + near_best))
