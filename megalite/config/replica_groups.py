"""--ft-replica-groups: what recovery without a restart (megalite/replicas/trainer.py) can run, refused
in one line each before any process group exists.

Each replica group is its own job and world, healed from a live one by copying its ZeRO shards, Adam's
moments and step count rank for rank, and the data position is the step's: so the groups must hold
the same layout and an AdamW state it can copy (ZeRO 0, 1 or 3: each rank's shard of the masters and moments;
ZeRO 2 is not proven, so refused; no loss scaler, no Muon), the batch must
not ramp, and the replicas are the groups themselves (no --dp-shard, DiLoCo or PowerSGD replicas inside
one). Pure Python: no torch.
"""
from __future__ import annotations

from megalite.config.choices import GradCompression, OptimizerKind, Precision


def replica_group_problems(cfg) -> list[str]:
    """The run's --ft-* settings against the rest (cfg: a RunConfig)."""
    ft, p = cfg.fault_tolerance, cfg.parallel
    groups = ft.ft_replica_groups
    if not groups:
        return []
    if ft.ft_group_id >= groups:
        return [f"--ft-group-id {ft.ft_group_id} is not a replica group of --ft-replica-groups {groups}; give each "
                f"group's job its own id in 0..{groups - 1}"]
    if not 1 <= ft.ft_min_groups <= groups:
        return [f"--ft-min-groups {ft.ft_min_groups} must be in [1, {groups}] (the replica groups of the run); "
                f"choose --ft-min-groups between 1 and --ft-replica-groups"]
    host, _, port = (ft.ft_store or "").rpartition(":")
    if not host or not port.isdigit():
        return [f"--ft-replica-groups needs --ft-store HOST:PORT, the run's store that outlives every group "
                f"(python -m megalite.fault_tolerance.store serves one), not {ft.ft_store!r}"]
    cannot = [name for name, refused in (
        (f"--zero {p.zero}", p.zero == 2),
        ("--dp-shard / --num-distributed-optimizer-instances",
         p.dp_shard is not None or p.num_distributed_optimizer_instances is not None),
        ("--diloco-inner-steps", bool(p.diloco_inner_steps)),
        ("--grad-compression powersgd", p.grad_compression != GradCompression.NONE),
        ("--fp16", cfg.precision.precision == Precision.FP16),
        ("--optimizer muon", cfg.optimizer.optimizer == OptimizerKind.MUON),
        ("--rampup-batch-size", cfg.training.rampup_batch_size is not None),
        ("--offload-optimizer", p.offload_optimizer)) if refused]
    if cannot:
        return [f"--ft-replica-groups heals ZeRO 0/1/3 AdamW state (fp32 or bf16) of groups whose replicas are the "
                f"groups themselves, at a fixed batch; it cannot run {cannot[0]}: drop it"]
    return []
