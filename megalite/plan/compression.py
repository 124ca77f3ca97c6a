"""PowerSGD's arithmetic (Vogels et al. 2019), pure: which gradients are compressed, at what rank,
and how many elements one step's reduction sends. No torch: the compressor
(megalite/data_parallel/powersgd.py) and the planner (communication.py) both decide with these
functions, so the estimate and the ledger cannot disagree.

A gradient of shape [n, ...] is viewed as an n x m matrix (m = the other dimensions' product).
At rank r' = min(r, n, m) it travels as P [n, r'] and Q [m, r']: r'(n + m) elements instead of
n*m. It is compressed when that shrinks it by at least `min_compression`
(n*m >= min_compression * r'(n + m)); 1-D gradients never are. Everything else is summed
uncompressed, in the same all-reduce as the P factors. Each replica group has its own pair of
all-reduces: the dense parameters' over dp x cp, the experts' over expert-dp when an MoE model
keeps them apart (ep > 1, or whole experts at etp 1 under tp); a group of one rank sends nothing.
Under hybrid sharding (--dp-shard S < dp) only the replicas' sum is compressed: every parameter's
pair of all-reduces runs over the dp/S replica group ('dp_replicate'), replacing its all-reduce of
the reduced shard, and the shard group's reduction (all-reduce or reduce-scatter) stays as it was
(megalite/data_parallel/grad_buffers.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

from megalite.config.choices import GradCompression
from megalite.config.model import GPTConfig
from megalite.plan.layout import head_stage, is_hybrid, stage_layers
from megalite.plan.moe import expert_dp_config, experts_apart, stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig

REDUCE_BYTES = 4  # P, Q and the uncompressed gradients travel in fp32


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(n, m) of the matrix a gradient of `shape` is compressed as; None for 0-D and 1-D."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def effective_rank(n: int, m: int, rank: int) -> int:
    """The rank actually used for an n x m matrix: never more than min(n, m)."""
    return min(rank, n, m)


def compresses(shape: tuple[int, ...], rank: int, min_compression: float) -> bool:
    """Whether a gradient of `shape` is sent as low-rank factors (see the module docstring)."""
    view = matrix_view(shape)
    if view is None:
        return False
    n, m = view
    return n * m >= min_compression * effective_rank(n, m, rank) * (n + m)


def sent_elements(shape: tuple[int, ...], rank: int, min_compression: float) -> int:
    """Elements one step's reduction sends for a gradient of `shape`: r'(n + m) or n*m."""
    if compresses(shape, rank, min_compression):
        n, m = matrix_view(shape)
        return effective_rank(n, m, rank) * (n + m)
    return math.prod(shape)


def reduction_elements(shapes: Iterable[tuple[int, ...]], rank: int, min_compression: float) -> int:
    """Elements one compressed step all-reduces (its P factors + uncompressed gradients, then its Q factors)."""
    return sum(sent_elements(tuple(s), rank, min_compression) for s in shapes)


# ---------------------------------------------------------------------------------------------
# The planner's side: the shapes of one rank's parameters, and its dp bytes
# ---------------------------------------------------------------------------------------------


def _mlp_shapes(model: GPTConfig, ffn: int, tp: int) -> list[tuple[int, ...]]:
    """The weights of an MLP of width `ffn` on one tp rank: fc1 (or fused gate+up), fc2."""
    mlp_in = ffn if model.flavour == "gpt2" else 2 * ffn
    return [(mlp_in // tp, model.hidden_size), (model.hidden_size, ffn // tp)]


def layer_param_shapes(model: GPTConfig, tp: int, moe_block: bool = False) -> list[tuple[int, ...]]:
    """Shapes of one transformer block's parameters on one tp rank, its experts left out (their
    sizes add up to plan.params.layer_params; an MoE block's (`moe_block`) to it plus
    plan.moe.dense_change_per_layer: the router [E, h] and a shared expert instead of the MLP)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    mlp_in = f if model.flavour == "gpt2" else 2 * f           # fc1 | fused gate+up
    norm = [(h,), (h,)] if model.flavour == "gpt2" else [(h,)]   # LayerNorm weight+bias | RMSNorm weight
    shapes = 2 * norm + [(qkv // tp, h), (h, model.num_attention_heads * d // tp)]
    if not moe_block:
        shapes += _mlp_shapes(model, f, tp)
    else:
        shapes.append((model.moe.num_experts, h))
        if model.moe.shared_expert_intermediate_size:
            shapes += _mlp_shapes(model, model.moe.shared_expert_intermediate_size, tp)
    if model.add_bias:  # column-parallel biases sharded, row-parallel biases replicated (an MoE block's MLP has none)
        shapes += [(qkv // tp,), (h,)] + ([] if moe_block else [(mlp_in // tp,), (h,)])
    return shapes


def stage_param_shapes(model: GPTConfig, cfg: RunConfig, stage: int) -> list[tuple[int, ...]]:
    """Shapes of the parameters one rank of pipeline stage `stage` holds, its experts left out
    (with stage_expert_shapes: plan.params.stage_params)."""
    h, tp, pp = model.hidden_size, cfg.parallel.tp, cfg.parallel.pp
    moe_layers = stage_moe_layers(model, cfg, stage)
    shapes = (stage_layers(model, cfg)[stage] - moe_layers) * layer_param_shapes(model, tp)
    if moe_layers:
        shapes += moe_layers * layer_param_shapes(model, tp, moe_block=True)
    vocab_shard = (model.padded_vocab_size(tp) // tp, h)
    if stage == 0:
        shapes.append(vocab_shard)
        if model.flavour == "gpt2":
            shapes.append((model.seq_length, h))
    if stage == head_stage(cfg):  # the last stage; stage 0 under DualPipeV
        shapes += [(h,), (h,)] if model.flavour == "gpt2" else [(h,)]
        if not model.tie_embeddings or pp > 1:  # the output layer, or the last stage's tied copy
            shapes.append(vocab_shard)
    return shapes


def stage_expert_shapes(model: GPTConfig, cfg: RunConfig, stage: int) -> list[tuple[int, ...]]:
    """Shapes of the experts one rank of stage `stage` holds: E/ep per MoE block, each split /etp
    (plan.moe.stage_expert_params elements)."""
    layers = stage_moe_layers(model, cfg, stage)
    if not layers:
        return []
    per_block = model.moe.num_experts // cfg.parallel.ep
    return layers * per_block * _mlp_shapes(model, model.moe.expert_ffn(model.ffn_hidden_size), cfg.etp_size)


def compression_groups(model: GPTConfig, cfg: RunConfig, stage: int) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(ledger group, parameter shapes) of every replica group PowerSGD reduces over on a rank of
    `stage`: the dense parameters over dp x cp, experts kept apart (ep > 1, or etp 1 under tp)
    over expert-dp ("edp"; otherwise with the dense ones); a group of one rank reduces nothing.
    [] without compression."""
    if cfg.parallel.grad_compression != GradCompression.POWERSGD:
        return []
    if is_hybrid(cfg):  # only the replicas' sum is compressed, every kind over the replica group
        return [("dp_replicate", stage_param_shapes(model, cfg, stage) + stage_expert_shapes(model, cfg, stage))]
    dense, experts, groups = stage_param_shapes(model, cfg, stage), stage_expert_shapes(model, cfg, stage), []
    if not experts_apart(model, cfg):
        dense = dense + experts
    elif expert_dp_config(cfg).dp > 1:
        groups.append(("edp", experts))
    if cfg.dp * cfg.parallel.cp > 1:
        groups.insert(0, ("dp" if cfg.parallel.cp == 1 else "dp_cp", dense))
    return groups


def compression_enabled(model: GPTConfig, cfg: RunConfig) -> bool:
    """PowerSGD replaces the gradient reduction: asked for, and more than one replica of some
    parameter (dp x cp, or the experts' expert-dp)."""
    if cfg.parallel.grad_compression != GradCompression.POWERSGD:
        return False
    return cfg.dp * cfg.parallel.cp > 1 or (experts_apart(model, cfg) and expert_dp_config(cfg).dp > 1)


def replace_dp_grad_bytes(out: dict[str, int], model: GPTConfig, cfg: RunConfig, stage: int) -> None:
    """In `out` (communication.communication_bytes), swap the gradient reduction for PowerSGD's, per
    replica group (dp or dp_cp, and edp for experts kept apart): at ZeRO 0 the all-reduce, at ZeRO
    1/2 the reduce-scatter, become all-reduces of 4 * sum(r'(n + m) per compressed matrix + numel
    per other gradient) bytes per step (after the warm-up steps). The ZeRO 1/2 parameter
    all-gathers are unchanged."""
    p = cfg.parallel
    for group, shapes in compression_groups(model, cfg, stage):
        out.pop(f"{group}/all_reduce" if p.zero == 0 or group == "dp_replicate" else f"{group}/reduce_scatter", None)
        sent = REDUCE_BYTES * reduction_elements(shapes, p.powersgd_rank, p.powersgd_min_compression)
        out[f"{group}/all_reduce"] = out.get(f"{group}/all_reduce", 0) + sent


def compressed_matrices(model: GPTConfig, cfg: RunConfig, stage: int) -> list[tuple[int, int, int]]:
    """(n, m, r') of every gradient a rank of `stage` compresses; [] without compression."""
    p, out = cfg.parallel, []
    for shape in [shape for _, shapes in compression_groups(model, cfg, stage) for shape in shapes]:
        if compresses(shape, p.powersgd_rank, p.powersgd_min_compression):
            n, m = matrix_view(shape)
            out.append((n, m, effective_rank(n, m, p.powersgd_rank)))
    return out


def compression_state_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """PowerSGD's state on one rank of `stage`: an fp32 residual share of every compressed matrix
    (n*m) and its Q (m*r'); 0 without compression."""
    return REDUCE_BYTES * sum(n * m + m * r for n, m, r in compressed_matrices(model, cfg, stage))
