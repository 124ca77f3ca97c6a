"""How many blocks each pipeline stage holds and re-runs, for a run's configuration.

Pure arithmetic on a GPTConfig and a RunConfig (megalite.config), from
megalite.pipeline.partition: local chunk c of stage r is model chunk c*pp + r (Megatron's
interleaved assignment), or under DualPipeV model chunks r and 2pp-1-r (its V: stage 0 holds the
embedding and the head, `head_stage`).
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from megalite.config.choices import Recompute, Schedule
from megalite.config.model import GPTConfig
from megalite.pipeline.partition import ChunkPlacement, chunk_layer_counts

if TYPE_CHECKING:
    from megalite.config import RunConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GB = 1e9


def is_v_shaped(cfg: RunConfig) -> bool:
    """DualPipeV: each stage holds model chunks r and 2pp-1-r (pipeline/partition.py's V placement). Another
    number of chunks per rank is the schedule's own refusal (schedules.check_schedule_args), counted here as
    Megatron's placement until then."""
    return cfg.schedule == Schedule.DUALPIPEV and cfg.parallel.pp > 1 and cfg.parallel.virtual_stages == 2


def chunk_placement_of(cfg: RunConfig) -> ChunkPlacement:
    """The placement the planner counts a run's chunks with (`is_v_shaped`)."""
    return ChunkPlacement.V if is_v_shaped(cfg) else ChunkPlacement.INTERLEAVED


def head_stage(cfg: RunConfig) -> int:
    """The stage holding the last model chunk (final norm, output layer, loss): pp-1, or 0 under DualPipeV."""
    return 0 if is_v_shaped(cfg) else cfg.parallel.pp - 1


def stage_layers(model: GPTConfig, cfg: RunConfig) -> list[int]:
    """Blocks held by each pipeline stage (all its chunks)."""
    p = cfg.parallel
    return list(_stage_layers(model.num_layers, p.pp, p.virtual_stages, p.decoder_first_stage_layers,
                              p.decoder_last_stage_layers, p.pipeline_layout, None, is_v_shaped(cfg)))


def recomputed_stage_layers(model: GPTConfig, cfg: RunConfig) -> list[int]:
    """Blocks of each stage that full recompute re-runs: all of them, or the first
    recompute_num_layers of each of its chunks; none without full recompute."""
    p = cfg.parallel
    if p.recompute != Recompute.FULL:
        return [0] * p.pp
    return list(_stage_layers(model.num_layers, p.pp, p.virtual_stages, p.decoder_first_stage_layers,
                              p.decoder_last_stage_layers, p.pipeline_layout, p.recompute_num_layers,
                              is_v_shaped(cfg)))


@lru_cache(maxsize=4096)
def _stage_layers(num_layers: int, pp: int, v: int, first: int | None, last: int | None, layout: str | None,
                  per_chunk_cap: int | None, v_shaped: bool = False) -> tuple[int, ...]:
    """Blocks of each stage: the sum over its chunks (model chunks r, r + pp, r + 2pp, ...; under
    DualPipeV's V r and 2pp-1-r), each counted up to `per_chunk_cap` (None: all). Cached: the planner's
    search asks for the same split for every candidate of one (pp, v), and at pp 128 the sum is 256
    chunks per stage."""
    counts = chunk_layer_counts(num_layers, pp, v, first, last, layout)
    if per_chunk_cap is not None:
        counts = [min(per_chunk_cap, c) for c in counts]
    if v_shaped:
        return tuple(counts[r] + counts[2 * pp - 1 - r] for r in range(pp))
    return tuple(sum(counts[r::pp]) for r in range(pp))


def local_seq_length(model: GPTConfig, cfg: RunConfig) -> int:
    """Tokens of each sequence one rank holds: s/cp (its two zigzag chunks; s at cp = 1)."""
    return model.seq_length // cfg.parallel.cp


def recompute_fraction(model: GPTConfig, cfg: RunConfig) -> float:
    """Share of all blocks whose forward full recompute runs twice (0 without it)."""
    return sum(recomputed_stage_layers(model, cfg)) / model.num_layers


def dp_group_name(cfg: RunConfig) -> str:
    """The ledger's name of the group parameters are replicated over: 'dp', or 'dp_cp' (dp x cp)."""
    return "dp" if cfg.parallel.cp == 1 else "dp_cp"


def is_hybrid(cfg: RunConfig) -> bool:
    """Hybrid sharding: ZeRO over --dp-shard S < dp ranks (x cp), replicated dp/S times."""
    return cfg.dp_shard < cfg.dp


def zero_group_name(cfg: RunConfig) -> str:
    """The ledger's name of the group ZeRO shards over: 'dp_shard' under hybrid sharding, else
    `dp_group_name` (over which the gradients are then reduced whole)."""
    return "dp_shard" if is_hybrid(cfg) else dp_group_name(cfg)


def zero_shard_ranks(cfg: RunConfig) -> int:
    """Ranks ZeRO spreads one replica's shards over: S x cp (dp x cp without hybrid sharding)."""
    return cfg.dp_shard * cfg.parallel.cp
