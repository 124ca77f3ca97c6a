"""DiLoCo's traffic (megalite/data_parallel/diloco.py), streamed or not, in comm.ledger's convention.

Under --diloco-inner-steps H the replica groups do not all-reduce the reduced shard every step
(plan/communication.add_replica_bytes); instead, after the steps at which a fragment is due
(megalite/config/diloco.py: one fragment every H/F steps, F = --diloco-fragments), each rank
all-reduces its fp32 masters of that fragment over 'dp_replicate' (4 bytes per owned element: the
fragment's parameters on this tp rank / S x cp at ZeRO 1-3, all of them at ZeRO 0), and at ZeRO 1/2
the shard group gathers the published parameters again ('dp_shard/all_gather', in the parameter dtype).
With --diloco-reduce-dtype bf16 the groups all-reduce their pseudo-gradients in bf16 instead: 2 bytes.
Memory: θ_outer and the momentum, 8 bytes per owned element (`outer_state_bytes`, in the optimizer state).
Every step also adds one float64 token count over 'dp_replicate' and, at ZeRO 1-3, the gradient norm's
world all-reduce carries one float32 slot per replica group (each group clips by its own norm):
`step_scalar_collectives` and `grad_norm_slots`.

`communication_bytes(..., step=t)` counts the step after which step t's fragment is due (1-based, as the
run counts); step=None counts the mean over one period of H steps (what the step-time model and the
link table use). Padding aside at S x cp > 1, as the replica all-reduce of hybrid sharding: the real
shard holds whole buckets, this counts the fragment's elements / (S x cp), rounded up; exact at S x cp = 1.
A gather at ZeRO 1/2 publishes the fragment's buckets, counted here as the fragment's own parameters (a
bucket holding two fragments' parameters is gathered at both syncs: exact at F = 1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.diloco import fragment_layers, synced_fragment
from megalite.config.model import GPTConfig
from megalite.plan.layout import DTYPE_BYTES, zero_group_name, zero_shard_ranks
from megalite.plan.params import layer_params, stage_params

if TYPE_CHECKING:
    from megalite.config import RunConfig


def is_diloco(cfg: RunConfig) -> bool:
    return cfg.parallel.diloco_inner_steps > 0


def fragment_params(model: GPTConfig, cfg: RunConfig) -> list[int]:
    """Parameters of each fragment on one tensor-parallel rank (DiLoCo refuses --pp: one stage holds all):
    its layers, the embeddings with the first, the final norm, output layer and MTP depths with the last."""
    p = cfg.parallel
    counts = fragment_layers(num_layers=model.num_layers, fragments=p.diloco_fragments)
    out = [layers * layer_params(model, p.tp) for layers in counts]
    embeddings = model.padded_vocab_size(p.tp) // p.tp * model.hidden_size
    embeddings += model.seq_length * model.hidden_size if model.flavour == "gpt2" else 0
    out[0] += embeddings
    out[-1] += stage_params(model, cfg, 0) - sum(out)  # the rest: final norm, output layer, MTP depths
    return out


def _owned(cfg: RunConfig, params: int) -> int:
    """Elements of `params` a rank's masters hold: a 1/(S x cp) shard at ZeRO 1-3, all of them at ZeRO 0."""
    return params if cfg.parallel.zero == 0 else -(-params // zero_shard_ranks(cfg))


def outer_step_bytes(model: GPTConfig, cfg: RunConfig, step: int) -> dict[str, int]:
    """'group/op' -> bytes of the outer step after (1-based) step `step` on one rank: {} when no fragment
    is due then or a single replica group runs (its all-reduce is over one rank)."""
    p = cfg.parallel
    fragment = synced_fragment(step, inner_steps=p.diloco_inner_steps, fragments=p.diloco_fragments)
    if fragment is None:
        return {}
    params, out = fragment_params(model, cfg)[fragment], {}
    if cfg.dp // cfg.dp_shard > 1:
        out["dp_replicate/all_reduce"] = DTYPE_BYTES[p.diloco_reduce_dtype] * _owned(cfg, params)
    if p.zero in (1, 2) and zero_shard_ranks(cfg) > 1:  # the outer step's parameters published in the shard group
        out[f"{zero_group_name(cfg)}/all_gather"] = params * DTYPE_BYTES[cfg.precision.precision]
    return out


def replace_replica_bytes(out: dict[str, int], model: GPTConfig, cfg: RunConfig, step: int | None) -> None:
    """In `out` (communication.communication_bytes), swap hybrid sharding's per-step replica all-reduce for
    DiLoCo's outer steps: step `step`'s, or (None) the mean per step over one period of H steps."""
    if not is_diloco(cfg):
        return
    out.pop("dp_replicate/all_reduce", None)
    steps = [step] if step is not None else range(1, cfg.parallel.diloco_inner_steps + 1)
    total: dict[str, int] = {}
    for t in steps:
        for key, n in outer_step_bytes(model, cfg, t).items():
            total[key] = total.get(key, 0) + n
    for key, n in total.items():
        out[key] = out.get(key, 0) + -(-n // len(steps))


def outer_state_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """θ_outer and the Nesterov momentum, fp32, for every element of a rank's masters (every fragment's own,
    held between its syncs): 8 bytes per owned element under DiLoCo, else 0."""
    return 8 * _owned(cfg, stage_params(model, cfg, 0)) if is_diloco(cfg) else 0


def grad_norm_slots(cfg: RunConfig) -> int:
    """float32 elements of the gradient norm's all-reduce: one per replica group under DiLoCo at ZeRO 1-3
    (optim/clip.reduce_square_sum: each group its own norm), else one."""
    groups = cfg.dp // cfg.dp_shard
    return groups if is_diloco(cfg) and cfg.parallel.zero > 0 and groups > 1 else 1
