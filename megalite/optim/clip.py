"""Global gradient norm and clipping over the whole (tp, pp, dp) mesh.

The norm must equal `torch.nn.utils.clip_grad_norm_` on the same model run at tp=pp=dp=1.
Each rank therefore adds the squares of the gradient elements it is *responsible* for and
one all-reduce sums them:

- a tp-sharded parameter (its shard spec `is_tp_sharded`): every tp rank counts its own shard;
  the shards are disjoint, so summing over the tp group counts each element once;
- a parameter replicated across tp (norm weights, row-parallel biases): identical on every
  tp rank (sequence-parallel grads are all-reduced over tp before this), so only tp_rank 0
  counts it;
- pipeline stages hold disjoint layers: summing over the pp group adds them;
- the tied embedding exists on the first and the last stage (declared `tied_across_stages`, both
  copies carry the same all-reduced gradient): only the first stage counts it;
- dp replicas hold the same (reduced) gradients: the sum runs over the model-parallel group
  (tp x pp) only, never over dp. A ZeRO optimizer whose ranks each hold a disjoint 1/dp
  shard of the gradients passes `sharded_over_dp=True` to also sum over dp. Context-parallel
  ranks are replicas like dp ranks (ZeRO shards over dp x cp): "dp" here means dp x cp.

- expert parallelism (ep > 1): ep ranks hold different experts, so the sum must also run over
  them. The sum then runs over the whole world, and a gradient replicated over its replica group
  (dense ones over dp x cp, experts over the expert-data-parallel group) is counted by the
  group's rank 0 only (`over_replicas`); ZeRO shards are disjoint and count everywhere.
- whole experts on every tp rank (etp = 1): replicated over tp like a norm weight, so tp rank 0
  counts them (the rank 0 of their expert-dp x tp group is a tp rank 0); under ZeRO their shards
  are disjoint over expert-dp x tp, so every tp rank counts its own.

- hybrid sharding (--dp-shard S < dp): ZeRO shards are disjoint within a shard group only and
  repeat in each of the dp/S replica groups: only replica group 0's ranks count theirs.

An inf/nan anywhere in a rank's gradients makes the global norm inf/nan on every rank
(the all-reduced sum propagates it), which is how callers skip a step everywhere.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.distributed.mesh import Mesh


def counts_in_grad_norm(param: torch.Tensor, mesh: Mesh, over_replicas: bool = False, sharded: bool = False,
                        replicas_apart: bool = False) -> bool:
    """True when this rank's copy of `param` contributes to the global gradient norm.

    over_replicas: the sum runs over the replicas too (ep > 1 without ZeRO sharding): only the
    first rank of the parameter's replica group counts it. sharded: this rank holds a ZeRO shard of
    the gradient (disjoint over the parameter's replica group)."""
    if P.is_tied_across_stages(param) and not mesh.is_first_stage:
        return False  # the first stage's copy stands for the tied embedding
    if sharded and mesh.dp_replicate_rank != 0 and not replicas_apart:  # (DiLoCo: each group its own norm)
        return False  # hybrid sharding: the shards repeat in every replica group; the first one counts them
    if sharded and mesh.experts_whole and P.is_expert_parallel(param):
        return True  # whole experts (etp = 1) are sharded over expert-dp x tp: the tp ranks hold disjoint pieces
    if not P.shard_spec(param).is_tp_sharded and mesh.tp_rank != 0:
        return False  # replicated across tp: tp_rank 0 stands for every copy
    if over_replicas:
        return (mesh.expert_dp_rank if P.is_expert_parallel(param) else mesh.dp_cp_rank) == 0
    return True


def reduce_square_sum(local_square_sum: torch.Tensor, mesh: Mesh, sharded_over_dp: bool = False,
                      replicas_apart: bool = False) -> torch.Tensor:
    """All-reduce a rank's float32 sum of squares into the global one (in place; returned).

    Sums over the model-parallel group (tp x pp); also over dp x cp when every rank of it holds
    a disjoint shard of the gradients (ZeRO). replicas_apart (DiLoCo): each replica group's own
    norm: one world all-reduce of a slot per replica group, each rank reading its group's.
    """
    if replicas_apart and sharded_over_dp and mesh.dp_replicate_size > 1:
        slots = torch.zeros(mesh.dp_replicate_size, dtype=local_square_sum.dtype, device=local_square_sum.device)
        slots[mesh.dp_replicate_rank] = local_square_sum
        comm.all_reduce(slots, comm.world_group())
        return local_square_sum.copy_(slots[mesh.dp_replicate_rank])
    if (sharded_over_dp and mesh.dp_size * mesh.cp_size > 1) or mesh.ep_size > 1:
        # dp x cp x tp x pp is the whole world: one all-reduce instead of two (ep > 1: experts differ
        # across the ep ranks, replicas counted once by `counts_in_grad_norm(..., over_replicas)`).
        comm.all_reduce(local_square_sum, comm.world_group())
    else:
        comm.all_reduce(local_square_sum, mesh.model_parallel_group)
    return local_square_sum


# CPU's norm kernel accumulates float32 lane by lane: at 1e8 elements its squared norm is 2% off (and
# torch.dot 0.3%), while .sum() adds in a cascade. Squaring a whole gradient for .sum() would cost a
# copy of it at the step's peak, so on CPU the squares are summed SQUARE_CHUNK elements at a time (a
# 1 MiB temporary) and the chunks added in float64. On CUDA the norm runs on the same reduction as
# .sum() (per-thread partials, then a tree), one pass with no temporary; --simulate's meta device
# takes that path too, where only the bytes matter.
SQUARE_CHUNK = 1 << 18


def square_sum(tensor: torch.Tensor) -> torch.Tensor:
    """float32 scalar: the sum of `tensor`'s squared elements, accurate to float32 at any size."""
    if tensor.device.type != "cpu":
        return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()
    flat = tensor.reshape(-1)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, flat.numel(), SQUARE_CHUNK):
        total += flat[start:start + SQUARE_CHUNK].float().square().sum()
    return total.float()


def local_square_sum(params: Sequence[torch.Tensor], mesh: Mesh,
                     grads: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """float32 scalar: the sum of squared gradient elements this rank is responsible for.

    Gradients of parameters this rank does not count still poison the result with inf/nan
    (multiplied by zero), so an overflow anywhere is never hidden by the counting rule.
    """
    grads = [p.grad for p in params] if grads is None else list(grads)
    if len(grads) != len(params):
        raise ValueError(f"got {len(grads)} gradients for {len(params)} parameters; pass one per parameter")
    device = next((g.device for g in grads if g is not None), mesh.device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for param, grad in zip(params, grads):
        if grad is None or grad.numel() == 0:
            continue
        square = square_sum(grad)
        total += square if counts_in_grad_norm(param, mesh, over_replicas=mesh.ep_size > 1) else square * 0.0
    return total


def global_grad_norm(params: Iterable[torch.Tensor], mesh: Mesh,
                     grads: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """The L2 norm of the gradient of the whole model, identical on every rank (float32 scalar).

    `params`: this rank's parameters (its tp shards of this pipeline stage, one dp replica).
    `grads`: their gradients if not in `param.grad` (e.g. fp32 main grads), None for none.
    """
    params = list(params)
    return reduce_square_sum(local_square_sum(params, mesh, grads), mesh).sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): the factor torch.nn.utils.clip_grad_norm_ applies."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, mesh: Mesh,
                   grads: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Scale the gradients in place so the global norm is at most `max_norm`; return the norm before.

    Same rule as `torch.nn.utils.clip_grad_norm_` (norm_type 2). A non-finite norm leaves
    the gradients untouched (the caller skips the step).
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}; use clip_grad=0 to disable clipping")
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    total_norm = global_grad_norm(params, mesh, grads)
    if torch.isfinite(total_norm):
        coefficient = clip_coefficient(total_norm, max_norm)
        for grad in grads:
            if grad is not None:
                grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total_norm


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], tp_group,
                                      grads: Sequence[torch.Tensor | None] | None = None) -> int:
    """Sum over tp the partial gradients of params declared `sequence_parallel_grad`.

    Under sequence parallelism each tp rank sees only its slice of the sequence, so norm
    weights and row-parallel biases get partial gradients per tp rank; they must be summed
    over the tp group before any dp reduction, norm or update. One coalesced all-reduce.
    Returns how many parameters were reduced. (The data-parallel engine does this itself
    when given the tp group; this is for code paths without it.)
    """
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    chosen = [g for p, g in zip(params, grads) if g is not None and P.is_sequence_parallel_grad(p)]
    if not chosen or comm.group_size(tp_group) == 1:
        return len(chosen)
    flat = torch.cat([g.reshape(-1).float() for g in chosen])
    comm.all_reduce(flat, tp_group)
    offset = 0
    for g in chosen:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(chosen)
