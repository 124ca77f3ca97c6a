"""How many blocks each pipeline stage holds and re-runs, for a run's configuration.

Pure arithmetic on a GPTConfig and a RunConfig (megalite.config), from
megalite.pipeline.partition: local chunk c of stage r is model chunk c*pp + r (Megatron's
interleaved assignment).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.model.config import GPTConfig

if TYPE_CHECKING:
    from megalite.config import RunConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GB = 1e9


def stage_layers(model: GPTConfig, cfg: RunConfig) -> list[int]:
    """Blocks held by each pipeline stage (all its chunks)."""
    counts, pp = cfg.chunk_layer_counts(model.num_layers), cfg.parallel.pp
    return [sum(counts[c] for c in range(len(counts)) if c % pp == r) for r in range(pp)]


def recomputed_stage_layers(model: GPTConfig, cfg: RunConfig) -> list[int]:
    """Blocks of each stage that full recompute re-runs: all of them, or the first
    recompute_num_layers of each of its chunks; none without full recompute."""
    if cfg.parallel.recompute != "full":
        return [0] * cfg.parallel.pp
    counts, pp, n = cfg.chunk_layer_counts(model.num_layers), cfg.parallel.pp, cfg.parallel.recompute_num_layers
    per_chunk = [c if n is None else min(n, c) for c in counts]
    return [sum(per_chunk[c] for c in range(len(counts)) if c % pp == r) for r in range(pp)]


def local_seq_length(model: GPTConfig, cfg: RunConfig) -> int:
    """Tokens of each sequence one rank holds: s/cp (its two zigzag chunks; s at cp = 1)."""
    return model.seq_length // cfg.parallel.cp


def recompute_fraction(model: GPTConfig, cfg: RunConfig) -> float:
    """Share of all blocks whose forward full recompute runs twice (0 without it)."""
    return sum(recomputed_stage_layers(model, cfg)) / model.num_layers
