"""Muon on one rank of a pipeline stage, as a stage-level figure: state saved, the exchange's mean bytes per
group and the Newton-Schulz FLOPs (what the estimate, its communication and timing, and --suggest use).

The matrices are plan/param_list.py's list, the same one the per-rank counts read (plan/muon_ranks.py,
plan/muon_shards.py): every 2-D parameter `is_hidden_matrix` gives Muon, attention's of a plain block or of
latent attention (MLA's down- and up-projections), the MLPs', the shared expert's, the local experts' and
the multi-token-prediction depths' (their projection and block). With M the tp-local Muon elements of the
stage's dense parameters (M_e of its local experts), M_t and M_te their parts split over tp, S the dense
shard count (dp x cp at ZeRO >= 1, else 1), S_e the experts' (expert-dp), w the wire bytes of an element
(2 in bf16 NS, 4 in fp32):

    optimizer state   4 M / S + 4 M_e / S_e fewer bytes than AdamW (one buffer, the momentum, not two)
    dp/all_to_all     2 w M / S  (its pieces to their owners, the owners' slices back; S > 1)
    edp/all_to_all    2 w M_e / S_e
    tp/all_to_all     2 w (M_t / S + M_te / S_e)  (the owners' tp hop: only matrices split over tp take it;
                      a replicated one, MLA's down-projections, is whole on each tp rank already)
    NS FLOPs          every logical matrix once on its owner; the busiest rank's share under the optimizer's
                      own assignment (plan/muon_ranks.py's `stage_shares`)

The bytes are the mean over the ranks (ledger keys; the ledger counts an all-to-all's whole input, self-part
included); each rank's own are plan/muon_ranks.py's, which --simulate compares. Pure arithmetic, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan.layout import is_hybrid, zero_group_name, zero_shard_ranks
from megalite.plan.moe import experts_apart
from megalite.plan.muon_ranks import stage_matrices, stage_shares, wire_bytes
from megalite.plan.muon_shards import stage_first_rank
from megalite.plan.param_list import stage_param_list

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class MuonCost:
    """What Muon adds to one rank of a pipeline stage (module docstring)."""

    dense_elements: int
    """M: tp-local Muon elements of the stage's dense parameters."""
    expert_elements: int
    """M_e: tp-local Muon elements of this rank's experts."""
    state_bytes_saved: int
    comm_bytes: dict[str, int]
    ns_flops_total: int
    """Every logical matrix of the stage (this ep rank's experts) once."""
    ns_flops_busiest: float
    """The busiest owner's share under the optimizer's assignment."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def stage_muon(model: GPTConfig, cfg: RunConfig, stage: int) -> MuonCost:
    """Muon's state, communication and Newton-Schulz work on one rank of `stage` (module docstring)."""
    params = [p for p in stage_param_list(model, cfg, stage) if p.hidden]
    m = sum(p.numel for p in params if not p.expert)
    m_e = sum(p.numel for p in params if p.expert)
    m_t = sum(p.numel for p in params if not p.expert and p.split)
    m_te = sum(p.numel for p in params if p.expert and p.split)
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    etp = cfg.etp_size if model.moe else tp
    zero = cfg.parallel.zero
    shards = zero_shard_ranks(cfg) if zero else 1  # S x cp: one replica group's (hybrid sharding)
    expert_shards = (zero_shard_ranks(cfg) // ep * (tp // etp)) if zero else 1
    wire, comm = wire_bytes(cfg), {}
    apart = experts_apart(model, cfg)  # experts in a replica group of their own, else sharded with the dense ones
    if shards > 1:
        comm[f"{zero_group_name(cfg)}/all_to_all"] = 2 * wire * _ceil(m + (0 if apart else m_e), shards)
    if m_e and expert_shards > 1 and apart:
        comm[("edp_shard" if is_hybrid(cfg) else "edp") + "/all_to_all"] = 2 * wire * _ceil(m_e, expert_shards)
    split = _ceil(m_t, shards) + (_ceil(m_te, expert_shards) if etp == tp else 0)
    if tp > 1 and split:
        comm["tp/all_to_all"] = 2 * wire * split
    steps = cfg.optimizer.muon_ns_steps
    total = sum(x.cost(steps) for x in stage_matrices(cfg, params))
    shares = stage_shares(model, cfg, stage, viewpoint=stage_first_rank(cfg, stage)) if params else {}
    busiest = max((sum(x.cost(steps) for x in share.whole) for share in shares.values()), default=0)
    return MuonCost(m, m_e, 4 * (_ceil(m, shards) + _ceil(m_e, expert_shards)), comm, total, busiest)
