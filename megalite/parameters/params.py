"""Per-parameter metadata: the one declared place for everything megalite knows about a parameter.

Four packages need to know things about a parameter that its tensor does not say:

| field                  | set by                              | read by                                      |
|------------------------|-------------------------------------|----------------------------------------------|
| shard_spec             | tensor-parallel layers, GPTModel    | init, checkpoints, grad norm, replica check  |
| sequence_parallel_grad | layers built with sequence_parallel | the DP wrapper (sums it over tp first)       |
| sequence_parallel_     | the same, and a user's              | the DP wrapper (refuses an undeclared norm   |
|   declared             | tensor_parallel.mark_sequence_parallel | among sequence-parallel layers)           |
| tied_across_stages     | GPTModel (tied embedding, pp > 1)   | the DP wrapper, grad norm, pipeline executor |
| expert_parallel        | moe/experts.py (each expert)        | the DP wrapper (reduces over expert-dp),     |
|                        |                                     | grad norm, checkpoints                       |
| grad_sink, main_grad   | the DP wrapper                      | linear layers' backward, executor, tests     |
| deferred               | the pipeline executor (ZB-H1's B)   | linear layers' backward                      |
| fp8_amax_group         | megalite.model.fp8_convert                | ZeRO-3's FP8 parameter gather                |
| fp8_gathered           | ZeRO-3's FP8 parameter gather       | the FP8 linear (its weight's cast)           |

They live in one typed object, `ParamInfo`, stored on the parameter as a single attribute
that only this module reads or writes. Undeclared parameters (a plain `nn.Linear` in a
user's model) get the defaults: replicated (`ShardSpec(shape)`), no sequence-parallel
reduction, not tied, gradients through autograd.

Where a weight gradient goes (see `tensor_parallel/layers.py: _LinearFunction`):
1. `deferred = (store, key)`: queued on a `WeightGradStore` for a later W pass;
2. else `grad_sink`: handed to the DP wrapper's accumulation (fp32 main grad, bucket readiness);
3. else returned to autograd, landing in `param.grad`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from megalite.parameters.sharding import ShardSpec

_ATTRIBUTE = "_megalite_info"

GradSink = Callable[[torch.Tensor, torch.Tensor], None]  # (param, grad) -> None


@dataclass
class ParamInfo:
    shard_spec: ShardSpec
    """Where this rank's tensor sits in the full logical tensor (tp sharding, fused blocks, padding)."""
    sequence_parallel_grad: bool = False
    """Under sequence parallelism each tp rank holds a partial gradient (norms, row biases, the
    GPT-2 position table): summed over tp before the dp reduction."""
    sequence_parallel_declared: bool = False
    """True once a model said either way (`declare`, `tensor_parallel.mark_sequence_parallel`): the
    DP wrapper refuses a norm among sequence-parallel layers that nobody declared."""
    tied_across_stages: bool = False
    """One half of the tied embedding held by the first and the last pipeline stage: its gradient
    is summed over the embedding group, and it counts once in the global norm (first stage)."""
    expert_parallel: bool = False
    """An expert's weight: ranks of the ep group hold different experts, so its gradient reduces
    over the expert-data-parallel group (dp*cp/ep ranks), not over dp x cp."""
    grad_sink: GradSink | None = None
    """Set by a data-parallel wrapper: weight gradients are handed here instead of autograd."""
    main_grad: torch.Tensor | None = None
    """Set by a data-parallel wrapper: the fp32 buffer view this parameter's gradient accumulates in
    (None under ZeRO-2 between a bucket's reduction and the next step's first gradient)."""
    deferred: tuple[Any, Hashable] | None = None
    """Set by the pipeline executor during a zero-bubble B pass: (WeightGradStore, key)."""
    fp8_amax_group: tuple | None = None
    """A weight its layer casts to FP8 tensorwise: (the group its amax spans, the tp group or None;
    whether its scale is rounded to a power of two, the recipe's `pow2_scales`);
    None for every other parameter. ZeRO-3 may then gather it in FP8 (--fp8-param-gather)."""
    fp8_gathered: tuple | None = None
    """Set by ZeRO-3's FP8 gather while the weight is gathered: (FP8 values [shape], 1/scale []),
    which its layer uses instead of casting the weight itself."""


def info(param: torch.Tensor) -> ParamInfo:
    """The parameter's metadata, created with the defaults on first use (its spec from its shape)."""
    found = getattr(param, _ATTRIBUTE, None)
    if found is None:
        found = ParamInfo(ShardSpec(tuple(param.shape)))
        setattr(param, _ATTRIBUTE, found)
    return found


def declare(param: torch.Tensor, *, shard_spec: ShardSpec | None = None, sequence_parallel_grad: bool | None = None,
            tied_across_stages: bool | None = None, expert_parallel: bool | None = None,
            fp8_amax_group: tuple | None = None) -> torch.Tensor:
    """Declare what a model knows about `param` (fields left None keep their value); returns it."""
    meta = info(param)
    if shard_spec is not None:
        if tuple(shard_spec.local_shape()) != tuple(param.shape):
            raise ValueError(f"shard spec {shard_spec} gives a local shape {shard_spec.local_shape()} but the "
                             f"parameter has shape {tuple(param.shape)}")
        meta.shard_spec = shard_spec
    if sequence_parallel_grad is not None:
        meta.sequence_parallel_grad = bool(sequence_parallel_grad)
        meta.sequence_parallel_declared = True
    if tied_across_stages is not None:
        meta.tied_across_stages = bool(tied_across_stages)
    if expert_parallel is not None:
        meta.expert_parallel = bool(expert_parallel)
    if fp8_amax_group is not None:
        meta.fp8_amax_group = fp8_amax_group
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec:
    return info(param).shard_spec


def is_sequence_parallel_grad(param: torch.Tensor) -> bool:
    return info(param).sequence_parallel_grad


def is_sequence_parallel_declared(param: torch.Tensor) -> bool:
    return info(param).sequence_parallel_declared


def is_tied_across_stages(param: torch.Tensor) -> bool:
    return info(param).tied_across_stages


def is_expert_parallel(param: torch.Tensor) -> bool:
    return info(param).expert_parallel


def main_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The DP wrapper's fp32 gradient view of `param`, or None when no wrapper holds one."""
    return info(param).main_grad


def set_grad_destination(param: torch.Tensor, sink: GradSink | None, main_grad: torch.Tensor | None) -> None:
    """A data-parallel wrapper attaches (or, with None, detaches) its accumulation."""
    meta = info(param)
    meta.grad_sink, meta.main_grad = sink, main_grad


def detach_grad_destinations(params, hooks: list) -> None:
    """A wrapper lets go of its parameters: removes its gradient hooks (emptying `hooks`) and detaches
    every accumulation it attached; what it accumulated stays readable."""
    for handle in hooks:
        handle.remove()
    hooks.clear()
    for p in params:
        set_grad_destination(p, None, None)


def set_main_grad(param: torch.Tensor, main_grad: torch.Tensor | None) -> None:
    """Re-point the main-grad view (ZeRO-2 allocates and frees bucket storage per step)."""
    info(param).main_grad = main_grad


def grad_sink(param: torch.Tensor) -> GradSink | None:
    return info(param).grad_sink


def set_deferred(param: torch.Tensor, deferred: tuple[Any, Hashable] | None) -> None:
    info(param).deferred = deferred


def deferred(param: torch.Tensor) -> tuple[Any, Hashable] | None:
    return info(param).deferred


def set_fp8_gathered(param: torch.Tensor, gathered: tuple | None) -> None:
    info(param).fp8_gathered = gathered


def fp8_gathered(param: torch.Tensor) -> tuple | None:
    return info(param).fp8_gathered


def copy_info(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Give `target` the declarations of `source` (a ZeRO-3 wrapper replacing a parameter built on
    the meta device by a real one); the wrapper attaches its own grad destination afterwards."""
    meta = info(source)
    setattr(target, _ATTRIBUTE, ParamInfo(meta.shard_spec, meta.sequence_parallel_grad,
                                          sequence_parallel_declared=meta.sequence_parallel_declared,
                                          tied_across_stages=meta.tied_across_stages,
                                          expert_parallel=meta.expert_parallel, fp8_amax_group=meta.fp8_amax_group))
    return target
