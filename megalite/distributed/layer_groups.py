"""The process groups one transformer layer talks over, as one bundle with one name per idea.

A block, its attention and its MoE layer take a `LayerGroups` instead of loose group arguments.
None for a group: one rank (no communication over it). It imports nothing from megalite: the
layers below model/ (moe/, context_parallel/) and model/ itself take it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerGroups:
    tp: Any = None  # tensor parallel: dense weights split over it (and the experts, unless experts_whole)
    cp: Any = None  # context parallel: the ranks holding the other zigzag chunks of each sequence
    ep: Any = None  # expert parallel: the ranks holding the other experts; routed tokens travel over it
    moe_tokens: Any = None  # the ranks routing one microbatch's tokens together: cp, or tp x cp when experts_whole
    experts_whole: bool = False  # etp = 1 < tp: whole experts on every tp rank, each routing its own tokens

    @classmethod
    def of(cls, mesh) -> LayerGroups:
        """This rank's groups in `mesh` (a megalite.distributed.mesh.Mesh); all None without one."""
        if mesh is None:
            return cls()
        return cls(tp=mesh.tp_group, cp=mesh.cp_group, ep=mesh.ep_group, moe_tokens=mesh.moe_token_group,
                   experts_whole=mesh.experts_whole)
