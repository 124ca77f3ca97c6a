"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Every layer builds its full master weight from the current torch RNG (the same seed gives the
same tensor on every rank), then keeps only this rank's slice. A layer at tp=4 is therefore
numerically the same layer as at tp=1, and with the default init a `ColumnParallelLinear(i, o)`
made after `torch.manual_seed(s)` has exactly the weights of `nn.Linear(i, o)` made after it.

`tp_group=None` means the tp group of the mesh made by `megalite.distributed.mesh.init_mesh`, or no
parallelism when no mesh exists.
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.distributed import comm
from megalite.parameters import params
from megalite.errors import ArgumentTypeError, positive_int
from megalite.fp8.linear import fp8_linear
from megalite.distributed.mesh import current_mesh
from megalite.tensor_parallel import mappings
from megalite.parameters.sharding import ShardSpec, validate_blocks
from megalite.parameters.weight_grad import bypasses_autograd, route_weight_grads

InitMethod = Callable[[torch.Tensor], object]


def resolve_tp_group(tp_group, owner: str = "a tensor-parallel layer"):
    """The explicit group, else the current mesh's tp group, else None (no parallelism).

    A layer made before `init_mesh` in a process of a multi-rank launch (WORLD_SIZE > 1) would
    silently run at tp 1: refused (pass `tp_group=` to choose explicitly). Anything but a process
    group or None is an ArgumentTypeError naming `owner`."""
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise ArgumentTypeError(f"{owner}: tp_group takes a torch.distributed ProcessGroup (e.g. init_mesh(tp=2)"
                                f".tp_group) or None (the current mesh's), got {tp_group!r} ({type(tp_group).__name__})")
    if tp_group is not None:
        return tp_group
    mesh = current_mesh()
    if mesh is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("a tensor-parallel layer built before init_mesh() under a multi-rank launch (WORLD_SIZE="
                           f"{os.environ['WORLD_SIZE']}) would run at tp 1: call megalite.distributed.mesh.init_mesh(tp=...) "
                           "before building the model, or pass tp_group= explicitly")
    return mesh.tp_group if mesh is not None else None


def _make_param(full: torch.Tensor, spec: ShardSpec, dtype, device) -> nn.Parameter:
    param = nn.Parameter(spec.shard(full).to(device=device, dtype=dtype or torch.get_default_dtype()))
    return params.declare(param, shard_spec=spec)


def _linear_default_init(in_features: int):
    """nn.Linear's init: kaiming_uniform(a=sqrt(5)) weight, U(+-1/sqrt(in)) bias."""
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    return (lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
            lambda b: nn.init.uniform_(b, -bound, bound))


class _LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b, whose weight gradients go where `weight_grad` routes them.

    x: [..., in]; weight: [out, in]; bias: [out] or None; y: [..., out].
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        ctx.params = (weight, bias)  # the parameters themselves: where their gradients go (bypasses_autograd)
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [tokens, out], shared by all three gradients
        # the GEMM grad_out.matmul(weight) ran (matmul folds grad_out to g2 itself), one view op fewer
        grad_input = g2.mm(weight).view(*grad_out.shape[:-1], weight.shape[1]) if needs[0] else None
        wants_bias = bias is not None and needs[2]
        if bypasses_autograd(ctx.params[0]):
            route_weight_grads(*ctx.params, _weight_grads, g2, x, needs[1], wants_bias)
            return grad_input, None, None
        return (grad_input, *_weight_grads(g2, x, needs[1], wants_bias))


def _weight_grads(g2, x, wants_weight: bool, wants_bias: bool):
    """(grad_weight [out, in], grad_bias [out]) of y = x @ W^T + b from g2 = grad_out as [tokens, out],
    each None when not wanted.

    A module-level function, not a closure made per backward: the backward runs once per layer
    and microbatch, and its host time is the step's time on small models (issue 26)."""
    x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
    return (g2.t().mm(x2) if wants_weight else None), (g2.sum(0) if wants_bias else None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose weight gradients honour megalite's routing (sink, deferral)."""
    return _LinearFunction.apply(x, weight, bias)


class _SequenceParallelLinearFunction(torch.autograd.Function):
    """All-gather the sequence, then y = x @ W^T + b, keeping only the shard for backward.

    x_shard: [s/tp, b, in]; weight: [out/tp, in]; y: [s, b, out/tp]. Backward re-gathers the
    input for the weight gradient (one more all-gather of [s, b, in]) instead of holding the
    gathered input from forward to backward (Korthikanti et al. 2022, as Megatron-LM does), and
    reduce-scatters the input gradient back to the sequence shard.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x_shard, weight, bias)
        ctx.params = (weight, bias)  # the parameters themselves: where their gradients go (bypasses_autograd)
        x = comm.all_gather(x_shard, group, dim=0)  # [s/tp, b, in] -> [s, b, in]
        out = torch.matmul(x, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight, bias = ctx.saved_tensors
        x = comm.all_gather(x_shard, ctx.group, dim=0)  # re-gathered: [s, b, in]
        grad_input = comm.reduce_scatter(grad_out.matmul(weight), ctx.group, dim=0) \
            if ctx.needs_input_grad[0] else None  # [s, b, in] partial sums -> [s/tp, b, in]
        wants_weight, wants_bias = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [tokens, out/tp]
        if bypasses_autograd(ctx.params[0]):
            route_weight_grads(*ctx.params, _weight_grads, g2, x, wants_weight, wants_bias)
            return grad_input, None, None, None
        return (grad_input, *_weight_grads(g2, x, wants_weight, wants_bias), None)


def sequence_parallel_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             tp_group) -> torch.Tensor:
    """Column-parallel linear on a sequence shard: [s/tp, b, in] -> [s, b, out/tp] (see above)."""
    if comm.group_size(tp_group) == 1:
        return linear(x_shard, weight, bias)
    return _SequenceParallelLinearFunction.apply(x_shard, weight, bias, tp_group)


class ColumnParallelLinear(nn.Module):
    """Linear layer with its output dimension split across tp ranks.

    weight: [out/tp, in] = rows [r*out/tp, (r+1)*out/tp) of the full nn.Linear weight; bias the same.
    With `fused_blocks=(a, b, ...)` the output is a concatenation of blocks (e.g. [Q; K; V]) each
    split separately: rank r holds [block0_r; block1_r; ...].

    Input: [..., in], the full activation (every tp rank the same), or with
    `sequence_parallel=True` the sequence shard [s/tp, b, in] (gathered here along dim 0; only the
    shard is kept for backward, which re-gathers it).
    Output: [..., out/tp], or [..., out] with `gather_output=True`.
    `fp8` (an Fp8Recipe, set by megalite.model.fp8_convert): the GEMMs run in FP8, the SP gather too;
    `fp8_tokens`: the cp group (the other tokens of x's sequences: the amaxes span it).
    """

    fp8 = None
    fp8_tokens = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 tp_group=None, sequence_parallel: bool = False, *, init_method: InitMethod | None = None,
                 bias_init_method: InitMethod | None = None, fused_blocks: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        positive_int("ColumnParallelLinear", "in_features", in_features)
        positive_int("ColumnParallelLinear", "out_features", out_features)
        self.tp_group = resolve_tp_group(tp_group, "ColumnParallelLinear")
        tp_size, tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        blocks = tuple(fused_blocks) if fused_blocks else (out_features,)
        if sum(blocks) != out_features:
            raise ValueError(f"fused_blocks {blocks} do not add up to out_features={out_features}")
        validate_blocks(blocks, tp_size, f"ColumnParallelLinear(out_features={out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.blocks = blocks
        default_w, default_b = _linear_default_init(in_features)
        full_weight = torch.empty(out_features, in_features)
        (init_method or default_w)(full_weight)
        self.weight = _make_param(full_weight, ShardSpec((out_features, in_features), 0, tp_rank, tp_size, blocks),
                                  dtype, device)
        if bias:
            full_bias = torch.empty(out_features)
            (bias_init_method or default_b)(full_bias)
            self.bias = _make_param(full_bias, ShardSpec((out_features,), 0, tp_rank, tp_size, blocks), dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:  # the same regions, the GEMMs (and the SP all-gather) in FP8
            x = x if self.sequence_parallel else mappings.copy_to_tensor_parallel_region(x, self.tp_group)
            y = fp8_linear(x, self.weight, self.bias, self.fp8, self.tp_group, "column", self.sequence_parallel,
                           self.fp8_tokens)
        elif self.sequence_parallel:  # [s/tp, b, in] -> [s, b, out/tp], keeping only the shard for backward
            y = sequence_parallel_linear(x, self.weight, self.bias, self.tp_group)
        else:
            y = linear(mappings.copy_to_tensor_parallel_region(x, self.tp_group), self.weight, self.bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.tp_group)  # [..., tp * out/tp], rank-major
            if len(self.blocks) > 1:  # rank-major [b0_0 b1_0 | b0_1 b1_1] -> block-major [b0_0 b0_1 | b1_0 b1_1]
                tp = comm.group_size(self.tp_group)
                pieces = [y_rank.split([b // tp for b in self.blocks], dim=-1) for y_rank in y.chunk(tp, dim=-1)]
                y = torch.cat([pieces[r][i] for i in range(len(self.blocks)) for r in range(tp)], dim=-1)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={comm.group_size(self.tp_group)}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Linear layer with its input dimension split across tp ranks.

    weight: [out, in/tp] = column slice r of the full nn.Linear weight; bias: [out], full, added
    once after the reduction. Input: [..., in/tp] (`input_is_parallel=True`, the output of a
    ColumnParallelLinear) or [..., in] (scattered here). Output: [..., out] summed over tp, or
    with `sequence_parallel=True` the reduce-scattered sequence shard [s/tp, b, out].
    `fp8` (an Fp8Recipe, set by megalite.model.fp8_convert): the GEMMs run in FP8; `fp8_tokens`: the cp group.
    """

    fp8 = None
    fp8_tokens = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 tp_group=None, sequence_parallel: bool = False, *, init_method: InitMethod | None = None,
                 bias_init_method: InitMethod | None = None, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        positive_int("RowParallelLinear", "in_features", in_features)
        positive_int("RowParallelLinear", "out_features", out_features)
        self.tp_group = resolve_tp_group(tp_group, "RowParallelLinear")
        tp_size, tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        validate_blocks((in_features,), tp_size, f"RowParallelLinear(in_features={in_features})")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        default_w, default_b = _linear_default_init(in_features)
        full_weight = torch.empty(out_features, in_features)
        (init_method or default_w)(full_weight)
        self.weight = _make_param(full_weight, ShardSpec((out_features, in_features), 1, tp_rank, tp_size),
                                  dtype, device)
        if bias:
            full_bias = torch.empty(out_features)
            (bias_init_method or default_b)(full_bias)
            self.bias = _make_param(full_bias, ShardSpec((out_features,)), dtype, device)
            # Under SP the bias is added to a sequence shard: its gradient is partial per tp rank.
            params.declare(self.bias, sequence_parallel_grad=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to the caller (a fused bias-dropout-add reads `self.bias`)."""
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.tp_group)  # [..., in] -> [..., in/tp]
        y = linear(x, self.weight, None) if self.fp8 is None else \
            fp8_linear(x, self.weight, None, self.fp8, self.tp_group, "row", tokens=self.fp8_tokens)  # partial sums
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # [s, b, out] -> [s/tp, b, out]
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y + self.bias if self.bias is not None and add_bias else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={comm.group_size(self.tp_group)}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its rows (the vocabulary) split across tp ranks.

    weight: [V_pad/tp, h] = row slice r of the full table, the vocabulary padded with zero rows
    to `padded_num_embeddings` (default: the next multiple of tp). Each rank looks up the ids it
    owns, zeroes the rest, and the partial results are summed over tp.
    Input ids [...]; output [..., h] (every tp rank the same).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, *,
                 padded_num_embeddings: int | None = None, init_method: InitMethod | None = None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        positive_int("VocabParallelEmbedding", "num_embeddings", num_embeddings)
        positive_int("VocabParallelEmbedding", "embedding_dim", embedding_dim)
        self.tp_group = resolve_tp_group(tp_group, "VocabParallelEmbedding")
        tp_size, tp_rank = comm.group_size(self.tp_group), comm.group_rank(self.tp_group)
        padded = padded_num_embeddings or tp_size * math.ceil(num_embeddings / tp_size)
        if padded < num_embeddings or padded % tp_size != 0:
            raise ValueError(f"padded_num_embeddings={padded} must be >= {num_embeddings} and divisible by tp={tp_size}")
        self.num_embeddings, self.embedding_dim, self.padded_num_embeddings = num_embeddings, embedding_dim, padded
        self.vocab_start_index = tp_rank * (padded // tp_size)
        self.vocab_end_index = self.vocab_start_index + padded // tp_size
        full = torch.empty(num_embeddings, embedding_dim)
        (init_method or nn.init.normal_)(full)
        spec = ShardSpec((num_embeddings, embedding_dim), 0, tp_rank, tp_size, padded_size=padded)
        self.weight = _make_param(full, spec, dtype, device)

    def local_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial embedding [..., h]: rows it owns, zeros elsewhere (not yet summed).
        An id outside [0, num_embeddings) fails as nn.Embedding's would (checked on the device: no host
        sync), instead of reading a padding row or another rank's zeros."""
        torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                            f"VocabParallelEmbedding: an input id is outside the vocabulary [0, {self.num_embeddings})")
        if comm.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        return F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return mappings.reduce_from_tensor_parallel_region(self.local_lookup(ids), self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"tp={comm.group_size(self.tp_group)}")
