"""Tensor-parallel-aware random numbers for dropout.

Two explicit generators per rank instead of reseeding the global one:
- `replicated`: the same stream on every tp rank. Used where every tp rank holds the same
  activation (hidden dropout after a row-parallel layer without sequence parallelism), so the
  replicas stay identical.
- `tensor_parallel`: a different stream per tp rank. Used inside parallel regions (attention
  dropout on this rank's heads; anything on a sequence-parallel shard), where each rank holds
  different data and identical masks would correlate them.

Both are seeded from the run's seed, the pipeline stage and the context-parallel rank (each
cp rank holds other tokens), so a run is reproducible. Their
states are part of checkpoints and are restored around activation recompute, so a recomputed
dropout mask equals the original one.
"""
from __future__ import annotations

import torch

_TP_OFFSET = 2718  # keeps the tp streams away from the replicated one (any constant works)
_CP_OFFSET = 7919  # cp ranks hold different tokens: their masks must differ (0 at cp rank 0: unchanged)


class TensorParallelRNG:
    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0, device: torch.device | str = "cpu",
                 cp_rank: int = 0):
        device = torch.device(device)
        offset = 100 * pp_rank + _CP_OFFSET * cp_rank
        self.replicated = torch.Generator(device=device)
        self.replicated.manual_seed(seed + 1 + offset)
        self.tensor_parallel = torch.Generator(device=device)
        self.tensor_parallel.manual_seed(seed + _TP_OFFSET + tp_rank + offset)

    def get_state(self) -> dict[str, torch.Tensor]:
        return {"replicated": self.replicated.get_state(), "tensor_parallel": self.tensor_parallel.get_state()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.replicated.set_state(state["replicated"])
        self.tensor_parallel.set_state(state["tensor_parallel"])


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None, training: bool = True) -> torch.Tensor:
    """Inverted dropout drawing its mask from `generator` (identity when p == 0 or not training)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    return x * keep * (1.0 / (1.0 - p))
