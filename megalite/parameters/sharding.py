"""How a parameter's local shard maps onto its full (logical, layout-free) tensor.

Every megalite parameter declares a `ShardSpec` (`megalite.parameters.params.shard_spec(param)`). It is
the single source of truth for:
- slicing a full master weight into this rank's shard at init (`shard`),
- checkpoints that load under any layout (`pieces`: local slice <-> full slice pairs),
- counting replicated parameters once in the global gradient norm (`is_tp_sharded`).

A sharded dimension may be *fused*: the full tensor is a concatenation of blocks along
`dim` (e.g. [Q; K; V] or [gate; up]) and every block is split across tp separately, so rank r
holds [Q_r; K_r; V_r]. The full tensor's layout then never depends on tp.

The full tensor may also be *padded* along `dim` (the vocabulary: Megatron pads it to a
multiple of 128 * tp). `logical_size` is the true size; rows at or past it are padding, zero
at init, dropped from checkpoints, and excluded from the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    """Shape of the full logical tensor (unpadded)."""
    dim: int | None = None
    """Dimension split across tp, or None when every tp rank holds the whole tensor."""
    tp_rank: int = 0
    tp_size: int = 1
    blocks: tuple[int, ...] | None = None
    """Sizes of fused blocks along `dim` (each split across tp separately); None: one block."""
    padded_size: int | None = None
    """Size along `dim` after padding (a multiple of tp); None: no padding."""

    @property
    def is_tp_sharded(self) -> bool:
        return self.dim is not None and self.tp_size > 1

    def _block_sizes(self) -> tuple[int, ...]:
        if self.blocks is not None:
            return self.blocks
        return (self.padded_size or self.full_shape[self.dim],)

    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b // self.tp_size for b in self._block_sizes())
        return tuple(shape)

    def pieces(self) -> list[tuple[int, int, int]]:
        """[(local_start, full_start, length)] along `dim`: the rows this rank holds, padding excluded.

        For an unsharded parameter: one piece covering everything (dim 0).
        """
        if self.dim is None:
            return [(0, 0, self.full_shape[0] if self.full_shape else 1)]
        logical = self.full_shape[self.dim]
        out, local_start, full_block_start = [], 0, 0
        for block in self._block_sizes():
            per_rank = block // self.tp_size
            full_start = full_block_start + self.tp_rank * per_rank
            length = max(0, min(per_rank, logical - full_start))
            if length > 0:
                out.append((local_start, full_start, length))
            local_start += per_rank
            full_block_start += block
        return out

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `full` (unpadded logical tensor); padding rows are zero."""
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(f"expected a full tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            return full.clone()
        local = torch.zeros(self.local_shape(), dtype=full.dtype, device=full.device)
        for local_start, full_start, length in self.pieces():
            local.narrow(self.dim, local_start, length).copy_(full.narrow(self.dim, full_start, length))
        return local

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full logical tensor from every tp rank's shard (rank order); padding dropped."""
        if self.dim is None:
            return shards[0].clone()
        if len(shards) != self.tp_size:
            raise ValueError(f"assemble needs {self.tp_size} shards, got {len(shards)}")
        full = torch.empty(self.full_shape, dtype=shards[0].dtype, device=shards[0].device)
        for rank, local in enumerate(shards):
            for local_start, full_start, length in replace(self, tp_rank=rank).pieces():
                full.narrow(self.dim, full_start, length).copy_(local.narrow(self.dim, local_start, length))
        return full


def validate_blocks(blocks: tuple[int, ...], tp_size: int, what: str) -> None:
    for block in blocks:
        if block % tp_size != 0:
            raise ValueError(f"{what}: block of size {block} is not divisible by tp={tp_size}")
