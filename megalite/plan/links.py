"""Per process group of one rank: the bytes it sends per step, the link it crosses, its seconds.

The step-time model (plan/timing.py) adds transfers up by part; this names them by group, so a
layout's choice of where a group's ranks sit (tp on NVLink, hybrid sharding's shard group inside
a node or a rack and only its replica all-reduce across) reads as bytes and seconds per link:

    group, ranks, link (intra-node / inter-node, from the group's span in the rank order and the
    profile's ranks per node), bus bandwidth, bytes per step (comm.ledger's sizes), transfer
    seconds, exposed seconds.

Exposed: tp, cp, pp, ep and the embedding's are exposed by the model (cp's ring sends shown
whole here); of the data-parallel family, hybrid sharding's replica all-reduce follows the
backward (exposed whole) and the shard group's gathers and reductions get what is left of the
closed form's exposed dp seconds (`StepTime.dp`). Pure arithmetic, no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan.comm_time import group_shape, stage_communication
from megalite.plan.communication import communication_bytes
from megalite.plan.hardware import load_profile
from megalite.plan.timing import MEGALITE, predict_step_time

if TYPE_CHECKING:
    from megalite.config import RunConfig

DATA_PARALLEL = ("dp", "dp_cp", "edp", "dp_shard", "edp_shard")  # overlapped with compute, in part


@dataclass(frozen=True)
class LinkUse:
    group: str
    ranks: int
    link: str  # "intra-node" or "inter-node"
    busbw_gbs: float
    bytes: int  # per step, comm.ledger's sizes (every op but receives)
    seconds: float  # transfer seconds per step
    exposed_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def link_uses(model: GPTConfig, cfg: RunConfig, hardware=None, ranks_per_node: int | None = None,
              stage: int = 0) -> list[LinkUse]:
    """Every group a rank of `stage` sends over, largest bytes first (see the module docstring)."""
    hw = load_profile(hardware)
    per_node = min(cfg.world_size, ranks_per_node or hw.devices_per_node or cfg.world_size)
    seconds: dict[str, float] = {}
    stage_communication(model, cfg, hw, MEGALITE, per_node, stage, 0.0, per_group=seconds)
    sent: dict[str, int] = {}
    for key, n in communication_bytes(model, cfg, stage).items():
        group, op = key.split("/")
        if op != "recv":
            sent[group] = sent.get(group, 0) + n
    closed = predict_step_time(model, cfg, hw, ranks_per_node)
    replicate = seconds.get("dp_replicate", 0.0)
    rest = max(0.0, closed.dp - replicate)  # what the closed form leaves exposed of the others
    dp_total = sum(seconds.get(g, 0.0) for g in DATA_PARALLEL) or 1.0
    out = []
    for group, n in sent.items():
        size, stride = group_shape(cfg, group) if group not in ("world", "mp") else (cfg.world_size, 1)
        if size <= 1:
            continue
        exposed = seconds.get(group, 0.0)
        if group in DATA_PARALLEL:
            exposed = rest * seconds.get(group, 0.0) / dp_total
        link = "intra-node" if size * stride <= per_node else "inter-node"
        out.append(LinkUse(group, size, link, hw.busbw(size, stride, per_node) / 1e9, n, seconds.get(group, 0.0),
                           exposed))
    return sorted(out, key=lambda use: -use.bytes)


def describe(uses: list[LinkUse]) -> str:
    lines = [f"    {'group':<13} {'ranks':>6} {'link':<11} {'GB/s':>6} {'GB/step':>9} {'seconds':>8} {'exposed':>8}"]
    for u in uses:
        lines.append(f"    {u.group:<13} {u.ranks:>6} {u.link:<11} {u.busbw_gbs:>6.0f} {u.bytes / 1e9:>9.3f} "
                     f"{u.seconds:>8.4f} {u.exposed_seconds:>8.4f}")
    return "\n".join(lines)
