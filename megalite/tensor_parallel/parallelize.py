"""Tensor parallelism by plan: `parallelize(module, mesh, plan)` shards a model megalite did not write.

A plan is data: {glob over `named_modules()` names: style}, applied once, in plan order (a module
takes the first pattern it matches), printable. torchtitan's `parallelize_module` has this shape;
behind it are megalite's own layers, so a planned model runs megalite's communication (one
choke point, the ledger) and checkpoints its parameters by their ShardSpecs.

    parallelize(model, mesh, {"*.q_proj": "column", "*.o_proj": "row", "model.embed_tokens": "vocab"})

Styles (a name or a style object; megalite/tensor_parallel/plans.py holds the ready plans for transformers' families):
- "column" / Column(): nn.Linear (or transformers' Conv1D, GPT-2's [in, out] layer) -> ColumnParallelLinear,
  output [..., out/tp] stays split.
  Column(gather_output=True) ("column_gather") gathers it ([..., out]), e.g. a head whose caller wants
  full logits; Column(blocks=(a, b)) splits each fused block apart ([gate; up] in one Linear).
- "row" / Row(): nn.Linear -> RowParallelLinear, input [..., in/tp], output summed over tp.
- "vocab" / Vocab(): nn.Embedding -> VocabParallelEmbedding, output [..., h] summed over tp.
- "experts" / Experts(): stacked expert weights (transformers' MoE: gate_up_proj [E, 2f, h],
  down_proj [E, h, f]) split along f; inputs enter a copy region, the output is summed over tp.
  Experts(split="experts") ("experts_ep"): expert parallelism over the tp ranks instead: rank r holds
  experts [r*E/tp, (r+1)*E/tp) whole and runs them on every token routed to them (the tokens are
  the same on every tp rank, so no all-to-all: routes to other ranks' experts are skipped here); the
  outputs are summed over tp.
- "heads" / Heads(): divide the module's head-count attributes by tp (code that reshapes by them).
Sequence parallelism (Megatron's SP, for batch-first code that reshapes by its input's length): the
residual stream between the blocks' halves is split along the sequence (dim `sequence_dim`) and a
module that needs every token (the attention, the MLP) gathers it at its input:
- "scatter_sequence" / ScatterSequence(): split the module's first input (the first block's) along the
  sequence; backward all-gathers its gradient;
- "gather_sequence" / GatherSequence(): all-gather the module's first input; backward reduce-scatters
  (its tp-split layers each give part of the input gradient). GatherSequence(grad_is_partial=False)
  ("gather_sequence_replicated") where what follows is replicated (the final norm): backward keeps
  this rank's slice;
- Column(sequence_parallel=True) ("column_sp"): its input was gathered by such a module (no copy
  region: the gather's backward reduces); Row(sequence_parallel=True) ("row_sp") reduce-scatters
  its output along the sequence;
- "partial_grad" / PartialGrad(): the module (a norm) runs on part of the work (its sequence shard under
  SP; its heads, for Qwen3's q/k norms): its replicated parameters' gradients are partial and declared
  so (the data-parallel wrapper sums them over tp).
The existing weights are sharded (no new initialisation): tp 2 is the tp 1 model tensor for tensor.
Parameters that were one tensor (a tied embedding and head) stay one tensor when both are sharded alike.
"""
from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from megalite.distributed import comm
from megalite.parameters import params
from megalite.errors import ArgumentTypeError
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, linear
from megalite.parameters.sharding import ShardSpec


@dataclasses.dataclass(frozen=True)
class Column:
    gather_output: bool = False
    sequence_parallel: bool = False
    """True: the input [..., in] was gathered along the sequence by its module's GatherSequence."""
    blocks: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    sequence_parallel: bool = False
    sequence_dim: int = 1


@dataclasses.dataclass(frozen=True)
class Vocab:
    pass


@dataclasses.dataclass(frozen=True)
class Experts:
    split: str = "width"
    """"width": every expert split along f over tp; "experts": E/tp whole experts per tp rank."""
    fused: str = "gate_up_proj"
    """[E, 2f, h]: [gate; up] along dim 1, each block split over tp."""
    out: str = "down_proj"
    """[E, h, f]: split along dim 2."""


@dataclasses.dataclass(frozen=True)
class Heads:
    attributes: tuple[str, ...] = ("num_heads", "num_key_value_heads", "num_attention_heads", "n_heads", "n_kv_heads")
    """Integer attributes divided by tp (GPT-2's attention also splits its fused output by `split_size`)."""


@dataclasses.dataclass(frozen=True)
class PartialGrad:
    pass


@dataclasses.dataclass(frozen=True)
class ScatterSequence:
    sequence_dim: int = 1


@dataclasses.dataclass(frozen=True)
class GatherSequence:
    sequence_dim: int = 1
    grad_is_partial: bool = True


STYLES = {"column": Column(), "column_gather": Column(gather_output=True), "row": Row(), "vocab": Vocab(),
          "column_sp": Column(sequence_parallel=True), "row_sp": Row(sequence_parallel=True), "experts": Experts(),
          "experts_ep": Experts(split="experts"),
          "heads": Heads(), "partial_grad": PartialGrad(), "scatter_sequence": ScatterSequence(),
          "gather_sequence": GatherSequence(), "gather_sequence_replicated": GatherSequence(grad_is_partial=False)}


class PlannedColumn(ColumnParallelLinear):
    """ColumnParallelLinear whose SP input [..., in] was already gathered by its module's GatherSequence
    (whose backward reduce-scatters the partial input gradient): no gather and no copy region here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return super().forward(x)
        y = linear(x, self.weight, self.bias)  # [..., out/tp]; the input gradient stays partial
        return mappings.gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


class PlannedRow(RowParallelLinear):
    """RowParallelLinear for batch-first activations: under SP [b, s, in/tp] -> [b, s/tp, out], the sequence
    dim `sequence_dim` moved first for megalite's reduce-scatter and back."""

    sequence_dim = 0

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        if not self.sequence_parallel or self.sequence_dim == 0:
            return super().forward(x, add_bias)
        return super().forward(x.transpose(0, self.sequence_dim), add_bias).transpose(0, self.sequence_dim).contiguous()


def _style(value, pattern: str):
    if isinstance(value, str):
        if value not in STYLES:
            raise ValueError(f"plan entry {pattern!r}: unknown style {value!r}; choose from {sorted(STYLES)}")
        return STYLES[value]
    if not isinstance(value, tuple(type(s) for s in STYLES.values())):
        raise ValueError(f"plan entry {pattern!r}: {value!r} is not a style; use a name from {sorted(STYLES)} "
                         f"or Column/Row/Vocab/Experts/Heads/PartialGrad/ScatterSequence/GatherSequence")
    return value


def _same_layout(a: ShardSpec, b: ShardSpec) -> bool:
    return (a.full_shape, a.dim, a.local_shape(), a.pieces()) == (b.full_shape, b.dim, b.local_shape(), b.pieces())


def _load(new: nn.Module, attribute: str, old: torch.Tensor | None, spec: ShardSpec | None, shared: dict) -> None:
    """Give `new` this rank's shard of the existing full tensor `old` under `spec` (None: the spec megalite's
    layer declared on its meta placeholder). A tensor already sharded alike (a tied weight) is reused."""
    if old is None:
        return
    placeholder = getattr(new, attribute)
    spec = spec or params.shard_spec(placeholder)
    earlier = shared.get(id(old))
    if earlier is not None and _same_layout(params.shard_spec(earlier), spec):
        setattr(new, attribute, earlier)
        return
    param = nn.Parameter(spec.shard(old.detach()), requires_grad=old.requires_grad)
    if placeholder is not None and placeholder.device.type == "meta":  # megalite's layer declared it
        params.copy_info(placeholder, param)
    params.declare(param, shard_spec=spec)
    setattr(new, attribute, param)
    shared[id(old)] = param


def _linear_weight(old: nn.Module, style) -> torch.Tensor:
    """The [out, in] weight of an nn.Linear, or of transformers' Conv1D (GPT-2's layers: y = x @ W + b with
    W [in, out], so its transpose; a new tensor that keeps requires_grad, never tied)."""
    if type(old) is nn.Linear:
        return old.weight
    if type(old).__name__ == "Conv1D" and old.weight.dim() == 2:
        return old.weight.detach().t().contiguous().requires_grad_(old.weight.requires_grad)
    raise ValueError(f"style {style} replaces an nn.Linear, got {type(old).__name__} (transformers' Conv1D is taken "
                     f"too)")


def _linear(old: nn.Module, style, group, shared: dict) -> nn.Module:
    weight = _linear_weight(old, style)  # [out, in]
    common = dict(bias=old.bias is not None, tp_group=group, sequence_parallel=style.sequence_parallel,
                  dtype=weight.dtype)
    out_features, in_features = weight.shape
    with torch.device("meta"):  # shapes and specs only: the weights are the existing ones, sharded
        if isinstance(style, Column):
            new = PlannedColumn(in_features, out_features, gather_output=style.gather_output,
                                fused_blocks=style.blocks, **common)
        else:
            new = PlannedRow(in_features, out_features, **common)
    if isinstance(style, Row):
        new.sequence_dim = style.sequence_dim
    _load(new, "weight", weight, None, shared)
    _load(new, "bias", old.bias, None, shared)
    return new.to(old.weight.device)


def _embedding(old: nn.Module, group, shared: dict) -> nn.Module:
    if type(old) is not nn.Embedding:
        raise ValueError(f"style Vocab() replaces an nn.Embedding, got {type(old).__name__}")
    with torch.device("meta"):
        new = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, group, dtype=old.weight.dtype)
    _load(new, "weight", old.weight, None, shared)
    if old.padding_idx is not None and new.vocab_start_index <= old.padding_idx < new.vocab_end_index:
        row = old.padding_idx - new.vocab_start_index  # nn.Embedding never updates its padding row

        def _keep_padding_row(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[row] = 0
            return grad

        new.weight.register_hook(_keep_padding_row)
    return new.to(old.weight.device)


def _experts(module: nn.Module, style: Experts, group, shared: dict) -> None:
    """Split stacked experts over tp: along their inner width f (rank r keeps [gate_r; up_r] and down's
    columns r) or by expert (rank r keeps experts [r*E/tp, (r+1)*E/tp) whole). Either way each rank's
    output is a partial sum over its share, summed over tp."""
    tp, rank = comm.group_size(group), comm.group_rank(group)
    fused, out = getattr(module, style.fused, None), getattr(module, style.out, None)
    if fused is None or out is None or fused.dim() != 3:
        raise ValueError(f"style Experts() needs stacked {style.fused} [E, 2f, h] and {style.out} [E, h, f] "
                         f"parameters, {type(module).__name__} has none")
    (num_experts, _, _), f = fused.shape, out.shape[2]
    if style.split == "experts":
        if num_experts % tp != 0 or not hasattr(module, "num_experts"):
            raise ValueError(f"{num_experts} experts are not divisible by tp={tp} (or {type(module).__name__} has no "
                             f"num_experts to narrow); choose tp dividing {num_experts} or Experts() (by width)")
        local = num_experts // tp
        _load(module, style.fused, fused, ShardSpec(tuple(fused.shape), 0, rank, tp), shared)
        _load(module, style.out, out, ShardSpec(tuple(out.shape), 0, rank, tp), shared)
        module.num_experts = local  # ids >= num_experts are other ranks' experts: skipped (the eager loop's
        if hasattr(module, "_is_expert_parallel"):  # last class; transformers' grouped_mm masks them when told)
            module._is_expert_parallel = True
        first = rank * local
    else:
        if f % tp != 0:
            raise ValueError(f"experts' inner width {f} is not divisible by tp={tp}; choose tp dividing {f}")
        _load(module, style.fused, fused, ShardSpec(tuple(fused.shape), 1, rank, tp, blocks=(f, f)), shared)
        _load(module, style.out, out, ShardSpec(tuple(out.shape), 2, rank, tp), shared)

    def to_local(index: torch.Tensor) -> torch.Tensor:  # [T, k] global expert ids -> local, others -> local count
        mine = (index >= first) & (index < first + local)
        return torch.where(mine, index - first, torch.full_like(index, local))

    def enter(_, args, kwargs):  # inputs (tokens, routing weights) replicated: their gradients are partial
        def one(x):
            if torch.is_tensor(x) and x.is_floating_point():
                return mappings.copy_to_tensor_parallel_region(x, group)
            if style.split == "experts" and torch.is_tensor(x):  # the routed expert ids
                return to_local(x)
            return x
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(lambda _, __, output: mappings.reduce_from_tensor_parallel_region(output, group))


def _heads(module: nn.Module, style: Heads, tp: int) -> None:
    for attribute in style.attributes:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp != 0:
                raise ValueError(f"{type(module).__name__}.{attribute}={value} is not divisible by tp={tp}")
            setattr(module, attribute, value // tp)


def _sequence_hook(module: nn.Module, style, group) -> None:
    """Scatter (or gather) the module's first input along `style.sequence_dim`."""
    dim = style.sequence_dim

    def move(x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, dim)
        if isinstance(style, ScatterSequence):  # backward: all-gather the sequence
            x = mappings.scatter_to_sequence_parallel_region(x.contiguous(), group)
        else:  # backward: reduce-scatter a partial gradient, or keep this rank's slice of a replicated one
            x = mappings.gather_from_sequence_parallel_region(x.contiguous(), group,
                                                              grad_is_partial=style.grad_is_partial)
        return x.transpose(0, dim)

    def hook(_, args, kwargs):
        if args:
            return (move(args[0]),) + tuple(args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: move(kwargs[key])}

    module.register_forward_pre_hook(hook, with_kwargs=True)
    if isinstance(style, GatherSequence):  # its own weights (the final norm's) see the whole sequence
        for param in module.parameters(recurse=False):
            params.declare(param, sequence_parallel_grad=False)


def _apply(root: nn.Module, name: str, style, group, shared: dict) -> None:
    module = root.get_submodule(name)
    if isinstance(style, (Column, Row, Vocab)):
        if not name:
            raise ValueError(f"style {style} replaces a submodule; the plan's '' names the model itself")
        new = _embedding(module, group, shared) if isinstance(style, Vocab) else _linear(module, style, group, shared)
        parent, _, leaf = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, leaf, new)
    elif isinstance(style, Experts):
        _experts(module, style, group, shared)
    elif isinstance(style, Heads):
        _heads(module, style, comm.group_size(group))
    elif isinstance(style, PartialGrad):
        for param in module.parameters():
            params.declare(param, sequence_parallel_grad=True)
    else:
        _sequence_hook(module, style, group)


def match_plan(module: nn.Module, plan: dict) -> dict[str, object]:
    """{module name: style} in `named_modules()` order; each module takes the first pattern it matches.
    Raises ValueError (one line) for an unknown style or a pattern that matches nothing."""
    styles = {pattern: _style(value, pattern) for pattern, value in plan.items()}
    matched, used = {}, dict.fromkeys(styles, 0)
    for name, _ in module.named_modules():
        for pattern, style in styles.items():
            if fnmatch.fnmatchcase(name, pattern):  # "" is the module itself
                matched[name] = style
                used[pattern] += 1
                break
    unused = [pattern for pattern, count in used.items() if count == 0]
    if unused:
        raise ValueError(f"plan patterns {unused} match no module of {type(module).__name__}; "
                         f"patterns are globs over named_modules() names such as 'model.layers.*.self_attn.q_proj'")
    return matched


def parallelize(module: nn.Module, mesh, plan: dict) -> nn.Module:
    """Apply `plan` ({glob: style}) to `module` in place over `mesh.tp_group` (None: no mesh, tp 1); returns it.

    No collective runs here, so a refusal (ValueError, one line) on any rank cannot hang the others."""
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"parallelize: module takes an nn.Module, got {type(module).__name__}")
    if mesh is not None and not hasattr(mesh, "tp_group"):
        raise ArgumentTypeError(f"parallelize: mesh takes a megalite Mesh (init_mesh(tp=...)) or None (tp 1), got "
                                f"{mesh!r} ({type(mesh).__name__})")
    if not isinstance(plan, dict) or not all(isinstance(pattern, str) for pattern in plan):
        raise ArgumentTypeError(f"parallelize: plan takes a dict {{glob: style}} (e.g. {{'*.q_proj': 'colwise', "
                                f"'*.o_proj': 'rowwise'}}), got {plan!r} ({type(plan).__name__})")
    group = mesh.tp_group if mesh is not None else None
    matched = match_plan(module, plan)
    shared: dict[int, nn.Parameter] = {}
    for name, style in matched.items():
        _apply(module, name, style, group, shared)
    return module
