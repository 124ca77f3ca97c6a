"""The planner's figures (megalite.plan) for one simulated rank, in `Measured`'s terms.

The planner reports the worst pipeline stage; here every term is the rank's own stage's:
model states (`stage_model_states`: ZeRO-3's gathered units and transient unit gradients
included), saved activations for the attention implementation the simulated blocks run (on the
meta device, the Triton kernels' autograd functions with their launches skipped: "triton", what a
GPU keeps; without the context-parallel ring's transient buffers, which the planner's activation
term holds but autograd does not, and without the block full recompute is re-running, whose saved
tensors torch's checkpoint keeps through its own hooks, which the tracker's hook does not see), the
planner's peak (the four terms and its transient buffers, plan/buffers.py; or the data-parallel
wrapper's set-up, plan/per_rank.setup_bytes, where larger), and the step's communication bytes summed
by group name.
"""
from __future__ import annotations

import collections

from megalite.config import RunConfig
from megalite.plan.activations import activation_bytes, context_parallel_buffer_bytes
from megalite.plan.buffers import buffer_bytes
from megalite.plan.communication import communication_bytes, step_scalar_collectives
from megalite.plan.diloco import grad_norm_slots
from megalite.plan.muon_stage import stage_muon
from megalite.plan.muon_ranks import muon_rank_terms
from megalite.plan.per_rank import setup_bytes, stage_model_states

SIMULATED_ATTENTION = "triton"  # rank_step runs the blocks under activation_probe.kernels_without_launch


def planned_terms(cfg: RunConfig, stage: int, attention: str | None = None, *, rank: int | None = None) -> dict:
    """{param_bytes, grad_bytes, optimizer_state_bytes, activation_peak_bytes, peak_bytes,
    comm_bytes: {group: bytes}} the planner counts for a rank of pipeline stage `stage` (`rank`: which
    global rank, where Muon's owners make the ranks of a stage differ: plan/muon_ranks.py)."""
    model = cfg.gpt_config()
    weights, grads, optimizer, _host = stage_model_states(model, cfg, stage, rank=rank)
    activations = activation_bytes(model, cfg, stage, attention or SIMULATED_ATTENTION)
    # the ring's / all-to-all's transient buffers (cp > 1) and the block full recompute re-runs are in the
    # planner's activation term, but autograd's hook does not see them kept (the first is not saved, the
    # second is saved through the checkpoint's own hooks): the peak holds them, the saved-activation figure not
    saved = activation_bytes(model, cfg, stage, attention or SIMULATED_ATTENTION, recomputing=False)
    saved -= context_parallel_buffer_bytes(model, cfg)
    by_group: dict[str, int] = collections.defaultdict(int)
    muon_comm, muon_step = muon_rank_terms(model, cfg, stage, rank=rank)
    if rank is not None and muon_comm:  # the rank's own exchange bytes for the stage's mean
        comm = collections.Counter(communication_bytes(model, cfg, stage, step=1))
        comm.subtract(stage_muon(model, cfg, stage).comm_bytes)
        comm.update(muon_comm)
    else:
        comm = communication_bytes(model, cfg, stage, step=1)  # the simulated step is the run's first (DiLoCo)
    for key, n in comm.items():
        by_group[key.split("/")[0]] += n
    for group, nbytes in scalar_collective_bytes(cfg).items():
        by_group[group] += nbytes
    buffers = buffer_bytes(model, cfg, stage, attention or SIMULATED_ATTENTION)  # one block's working tensors at the peak (plan/buffers.py)
    return {"param_bytes": weights, "grad_bytes": grads, "optimizer_state_bytes": optimizer,
            "activation_peak_bytes": saved,
            # the optimizer step's working set (Muon's exchange) comes after the activations are freed
            "peak_bytes": max(weights + grads + optimizer + max(activations + buffers, muon_step),
                              setup_bytes(model, cfg, weights, grads)),
            "comm_bytes": dict(by_group)}


def scalar_collective_bytes(cfg: RunConfig) -> dict[str, int]:
    """The one-element all-reduces of a step by group (`step_scalar_collectives` counts them), in
    their dtypes: the target-token count, the mean loss and each MTP depth's loss in float64 (8 bytes), the loss's
    finiteness flag and the gradient norm's square in float32 (4)."""
    out, depths = {}, cfg.gpt_config().mtp_num_layers
    for group, (_, count) in step_scalar_collectives(cfg).items():
        if group == "world":  # finiteness flag (4) + mean loss (8), the MTP depths' losses (8 D, one all-reduce),
            # and the gradient norm (4) under ZeRO (DiLoCo: a slot per replica group)
            out[group] = 4 + 8 + 8 * depths + 4 * (count - 2 - (depths > 0)) * grad_norm_slots(cfg)
        elif group == "mp":
            out[group] = 4 * count
        else:  # the token count over dp x cp
            out[group] = 8 * count
    return out
