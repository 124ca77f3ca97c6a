"""The step-time model's communication: each transfer's seconds from its bytes, its group's shape
in the rank order and the link it crosses (plan/hardware.py), per pipeline stage and step.

Split from timing.py, which adds these seconds to the compute, bubble and optimizer terms.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan import fp8_amax
from megalite.plan.communication import bus_factor, communication_bytes
from megalite.plan.compression import compressed_matrices, compression_enabled
from megalite.plan.layout import DTYPE_BYTES, is_hybrid, zero_group_name
from megalite.plan.params import stage_params
from megalite.plan.zero3 import stage_units

if TYPE_CHECKING:
    from megalite.config import RunConfig


def step_tokens(model: GPTConfig, cfg: RunConfig) -> tuple[int, int]:
    """(tokens of one microbatch on this rank, local sequence length): s / cp per sequence."""
    cp = getattr(cfg.parallel, "cp", 1)
    local = model.seq_length // cp
    return local * cfg.training.micro_batch_size, local


def group_shape(cfg: RunConfig, group: str) -> tuple[int, int]:
    """(size, stride in ranks) of a process group in megalite's order tp -> cp -> dp -> pp."""
    tp, cp, dp, pp = cfg.parallel.tp, getattr(cfg.parallel, "cp", 1), cfg.dp, cfg.parallel.pp
    ep = getattr(cfg.parallel, "ep", 1)  # expert parallelism folds into dp x cp: ep consecutive, then expert-dp
    whole = tp // cfg.etp_size  # etp 1: expert-dp spans the tp ranks too (tp consecutive, blocks ep*tp apart)
    shard = cfg.dp_shard  # hybrid sharding: S consecutive dp ranks (x cp) shard; replicas S*cp*tp ranks apart
    return {"tp": (tp, 1), "cp": (cp, tp), "dp": (dp, tp * cp), "dp_cp": (dp * cp, tp), "pp": (pp, tp * cp * dp),
            "ep": (ep, tp), "tp_cp": (tp * cp, 1), "edp": (dp * cp // ep * whole, tp * ep // whole),
            "embedding": (2, tp * cp * dp * max(1, pp - 1)), "dp_shard": (shard * cp, tp),
            "dp_replicate": (dp // shard, tp * cp * shard),
            "edp_shard": (shard * cp // ep * whole, tp * ep // whole)}[group]


def transfer_seconds(cfg, hw, ranks_per_node, group: str, op: str, nbytes: int, unit: int) -> float:
    """Seconds of `nbytes` (ledger convention) of `op` on `group`, in transfers of `unit` bytes each."""
    size, stride = group_shape(cfg, group)
    if size <= 1 or nbytes <= 0:
        return 0.0
    factor = 1.0 if op in ("send", "recv") else bus_factor(op, size)
    link = hw.busbw(2 if op in ("send", "recv") else size, stride, ranks_per_node)
    count = max(1, math.ceil(nbytes / max(unit, 1)))
    return nbytes * factor / link + count * hw.collective_latency_s(2 if op in ("send", "recv") else size)


def stage_communication(model, cfg, hw, kernels, ranks_per_node, stage: int, attention: float,
                        per_group: dict[str, float] | None = None) -> dict[str, float]:
    """Exposed tp, cp and pp seconds of one stage per step, and its dp/embedding transfer seconds.
    `per_group`, when given, receives each process group's transfer seconds (plan/links.py)."""

    def timed(group: str, op: str, nbytes: float, per_op: float) -> float:
        seconds = transfer_seconds(cfg, hw, ranks_per_node, group, op, nbytes, per_op)
        if per_group is not None:
            per_group[group] = per_group.get(group, 0.0) + seconds
        return seconds

    a, t, m = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp, cfg.num_microbatches
    tokens, _ = step_tokens(model, cfg)
    unit = a * tokens * model.hidden_size                                # one [s, b, h] activation
    sp = cfg.parallel.sequence_parallel
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp_reduce": _compression_seconds(model, cfg, hw, stage), "dp_gather": 0.0,
           "dp_first_unit": 0.0, "embedding": 0.0, "dp_replicate": 0.0}
    buckets = max(1, math.ceil(stage_params(model, cfg, stage) / cfg.parallel.ddp_bucket_size))
    amaxes = fp8_amax.amax_all_reduces(model, cfg, stage)  # FP8's scales: many tiny all-reduces, timed apart
    for group, (count, nbytes) in amaxes.items():
        part = {"cp": "cp", "dp": "dp_gather", "dp_cp": "dp_gather", "dp_shard": "dp_gather"}.get(group, "tp")
        out[part] += timed(group, "all_reduce", nbytes, nbytes / count)
    for key, nbytes in communication_bytes(model, cfg, stage, kernels.reentrant_recompute).items():
        group, op = key.split("/")
        nbytes -= amaxes.get(group, (0, 0))[1] if op == "all_reduce" else 0
        if op == "recv":
            continue                                                     # a transfer is one send and one receive
        if group == "pp":
            if kernels.p2p_scatter_gather and not sp and t > 1:          # 1/tp on the link, all-gather over tp
                out["pp"] += timed("pp", op, nbytes // t, unit // t)
                out["pp"] += timed("tp", "all_gather", nbytes, unit)
            else:
                out["pp"] += timed("pp", op, nbytes, unit // (t if sp else 1))
        elif group == "ep":  # MoE token dispatch: on the critical path like tp's, counted with it
            out["tp"] += timed("ep", op, nbytes, unit)
        elif group == "dp_replicate":  # hybrid sharding: after the shard group's reduction (bucket by bucket;
            per_op = nbytes if cfg.parallel.zero == 3 else nbytes // buckets  # ZeRO-3: the step's shard at once;
            if compression_enabled(model, cfg):  # PowerSGD compresses only the replicas' sum: P, then Q)
                per_op = nbytes // 2
            out["dp_replicate"] += timed(group, op, nbytes, per_op)
        elif group in ("dp", "dp_cp", "edp", "dp_shard", "edp_shard"):
            part = "dp_gather" if op == "all_gather" else "dp_reduce"
            per_op = _dp_transfer_bytes(model, cfg, stage, op, nbytes, buckets)
            out[part] += timed(group, op, nbytes, per_op)
        elif group == "cp":
            seconds = timed("cp", op, nbytes, unit)
            if op == "send":                                             # ring: the next K/V travels during a block
                seconds = max(0.0, seconds - m * attention)
            out["cp"] += seconds
        elif group in ("tp", "embedding"):
            out[group] += timed(group, op, nbytes, unit)
    if cfg.parallel.zero == 3 and cfg.dp * getattr(cfg.parallel, "cp", 1) > 1:  # nothing precedes a pass's first unit
        first = max(stage_units(model, cfg, stage)) * a
        passes = 2 * m * cfg.parallel.virtual_stages                     # every forward and backward
        out["dp_first_unit"] = passes * transfer_seconds(cfg, hw, ranks_per_node, zero_group_name(cfg), "all_gather",
                                                          first, first)  # within the gathers' own seconds
    return out


def _dp_transfer_bytes(model, cfg, stage: int, op: str, nbytes: int, buckets: int) -> int:
    """Bytes of one dp collective: a bucket; ZeRO-3: one unit (the stage's mean), gathered in the
    parameter dtype, reduce-scattered in the gradient's; PowerSGD: half of a step's (P, then Q)."""
    if cfg.parallel.zero == 3:
        units = stage_units(model, cfg, stage)
        dtype = cfg.precision.precision if op == "all_gather" else cfg.precision.grad_reduce_dtype
        return DTYPE_BYTES[dtype] * sum(units) // len(units)
    if compression_enabled(model, cfg) and op == "all_reduce" and not is_hybrid(cfg):  # (hybrid: dp_replicate's)
        return nbytes // 2
    return nbytes // buckets


def _compression_seconds(model, cfg, hw, stage: int) -> float:
    """PowerSGD's arithmetic on a rank of `stage` per step: per compressed n x m gradient (rank r),
    P = M Q, Q = M^T P^ and the decompression P^ Q^T (fp32 GEMMs), and 28 bytes per element of
    fp32 passes (M = G + residual: read 8, write 4; the new residual: read M and P^ Q^T, write 4;
    the decompressed sum written: 4). The orthogonalisation of the thin P is left out."""
    seconds = 0.0
    for n, m, r in compressed_matrices(model, cfg, stage):
        seconds += hw.matmul_seconds(n, r, m, "fp32") + hw.matmul_seconds(m, r, n, "fp32")
        seconds += hw.matmul_seconds(n, m, r, "fp32") + hw.memory_seconds(28 * n * m)
    return seconds
