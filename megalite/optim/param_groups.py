"""torch-style parameter groups over the shard a DataParallel wrapper hands its optimizer.

A group is a dict as torch.optim takes it: {"params": [tensors], "lr": ..., "weight_decay": ...,
"betas": (b1, b2), "eps": ...}. The DistributedOptimizer never sees tensors when it updates:
it sees its flat fp32 shard, in which each parameter it owns is one or more pieces
(`OwnedPiece`: [shard_start, shard_end)). This module turns groups into what the update needs:
for every group, the shard runs of its parameters' pieces, merged where contiguous.

Without groups (`params=None`), the default is torch's usual two groups: weight decay on
every parameter except biases and norm weights (`no_weight_decay`), none on those.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

HYPER_KEYS = ("lr", "betas", "eps")  # what the Adam update reads; weight_decay is applied per group apart


def default_groups(names: list[str], params: list[torch.Tensor], weight_decay: float,
                   no_weight_decay: Callable[[str, torch.Tensor], bool]) -> list[dict]:
    """[decayed group, not decayed group] in the wrapper's parameter order; an empty group is left out."""
    decayed = [p for n, p in zip(names, params) if not no_weight_decay(n, p)]
    kept = [p for n, p in zip(names, params) if no_weight_decay(n, p)]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def as_group_list(params: Iterable) -> list[dict]:
    """torch.optim's two spellings: an iterable of tensors (one group) or of group dicts."""
    items = list(params)
    if not items:
        raise ValueError("DistributedOptimizer got an empty parameter list; pass None for every parameter of the "
                         "model, or group dicts over model.parameters()")
    if all(isinstance(item, dict) for item in items):
        return [dict(item) for item in items]
    if any(isinstance(item, dict) for item in items):
        raise ValueError("DistributedOptimizer params mixes tensors and group dicts; pass one or the other")
    return [{"params": items}]


def check_cover(groups: list[dict], names: list[str], params: list[torch.Tensor]) -> None:
    """Every parameter the wrapper trains is in exactly one group, and nothing else is (one line each)."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: dict[int, int] = {}
    for g, group in enumerate(groups):
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError(f"param group {g} holds a tensor of shape {tuple(p.shape)} that the DataParallel "
                                 f"wrapper does not train; build groups from the wrapped model's parameters")
            if id(p) in seen:
                raise ValueError(f"parameter {names[index[id(p)]]!r} is in param groups {seen[id(p)]} and {g}; "
                                 f"put it in one")
            seen[id(p)] = g
    missing = [names[i] for i, p in enumerate(params) if id(p) not in seen]
    if missing:
        raise ValueError(f"param groups leave out {missing[:3]}{' ...' if len(missing) > 3 else ''}; every "
                         f"trained parameter must be in one group (or set requires_grad=False before wrapping)")


def group_runs(groups: list[dict], params: list[torch.Tensor], pieces) -> list[list[tuple[int, int]]]:
    """Per group: the [start, end) shard runs of the pieces this rank owns of its parameters."""
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    runs: list[list[list[int]]] = [[] for _ in groups]
    for piece in sorted(pieces, key=lambda x: x.shard_start):
        mine = runs[group_of[id(params[piece.param])]]
        end = piece.shard_start + piece.numel
        if mine and mine[-1][1] == piece.shard_start:
            mine[-1][1] = end
        else:
            mine.append([piece.shard_start, end])
    return [[(a, b) for a, b in group] for group in runs]


def clip_runs(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of `runs` inside [lo, hi), relative to lo (one bucket's chunk of the shard)."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in runs if max(a, lo) < min(b, hi)]


def same_update(groups: list[dict]) -> bool:
    """Whether every group's Adam update reads the same hyper-parameters (then a bucket updates in one pass)."""
    first = tuple(groups[0][k] for k in HYPER_KEYS)
    return all(tuple(g[k] for k in HYPER_KEYS) == first for g in groups[1:])
