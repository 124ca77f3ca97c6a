"""ZeRO-3 units: the groups of parameters that are gathered, freed and reduced together.

A unit is what FSDP wraps: a transformer block, the embedding, the final norm with the output
layer. Its parameters are one flat range (one bucket of `layout.build_unit_layout`) of which
each dp rank keeps a 1/dp shard; the full parameters exist only while the unit is gathered.

    Unit(name, params, modules=(block,))      # gathered when `block`'s forward starts
    Unit(name, params, modules=())            # gathered when one of its parameters is first read

`modules` are the modules whose forward call starts the unit (a forward pre-hook); a unit
without them (GPT's embedding, read through `F.embedding` inside the model's own forward)
starts at the first read of one of its parameters, which the wrapper's read guard sees.
`materialize`, for a model built on the meta device, returns the unit's tensors (this rank's
tp shards, in `params` order) built from the model's own seeded stream, one unit at a time.

Which units a model has:
- a model with a `zero3_units()` method (megalite's GPTModel) says so itself;
- `units=[module, ...]` given to DataParallel: one unit per module (its parameters not already
  claimed by an earlier unit);
- otherwise the default: every element of an `nn.ModuleList` child is a unit, every other
  child module holding parameters is a unit, and the chunk's own parameters form one more.
Parameters no listed unit covers form a last unit of their own (`rest`), so every parameter
belongs to exactly one unit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from megalite.parameters import params as P


@dataclass
class Unit:
    name: str
    params: list[nn.Parameter]
    modules: tuple[nn.Module, ...] = ()
    materialize: Callable[[], list[torch.Tensor]] | None = field(default=None, repr=False)
    chunk: int = 0  # which model chunk (pipeline virtual stage) of the replica it belongs to
    kind: int = 0  # its replica group: 0 dense (dp x cp), 1 experts (the expert-data-parallel group)


def _trainable(module: nn.Module, claimed: set[int]) -> list[nn.Parameter]:
    out = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in claimed:
            claimed.add(id(p))
            out.append(p)
    return out


def default_units(chunk: nn.Module) -> list[Unit]:
    """ModuleList elements, other parameter-holding children, then the chunk's own parameters."""
    units, claimed = [], set()
    for child_name, child in chunk.named_children():
        children = list(child.named_children()) if isinstance(child, nn.ModuleList) else [("", child)]
        for sub_name, module in children:
            params = _trainable(module, claimed)
            if params:
                units.append(Unit(f"{child_name}.{sub_name}" if sub_name else child_name, params, (module,)))
    own = [p for p in chunk.parameters(recurse=False) if p.requires_grad and id(p) not in claimed]
    if own:
        claimed.update(id(p) for p in own)
        units.append(Unit("root", own))
    return units


def resolve_units(chunks: Sequence[nn.Module], units: Sequence | None) -> list[Unit]:
    """The units of every chunk, in forward order (see the module docstring); every trainable
    parameter in exactly one unit."""
    resolved: list[Unit] = []
    claimed: set[int] = set()
    for c, chunk in enumerate(chunks):
        if units is not None:
            found = [u if isinstance(u, Unit) else Unit(type(u).__name__, list(u.parameters()), (u,)) for u in units]
        elif hasattr(chunk, "zero3_units"):
            found = chunk.zero3_units()
        else:
            found = default_units(chunk)
        for unit in found:
            params = [p for p in unit.params if p.requires_grad and id(p) not in claimed]
            if params:
                claimed.update(id(p) for p in params)
                resolved.append(Unit(unit.name, params, tuple(unit.modules), unit.materialize, c, unit.kind))
        rest = [p for p in chunk.parameters() if p.requires_grad and id(p) not in claimed]
        if rest:
            claimed.update(id(p) for p in rest)
            resolved.append(Unit("rest", rest, (), None, c))
    if not resolved:
        raise ValueError("ZeRO-3 needs at least one parameter with requires_grad=True")
    return resolved


def split_tied(units: list[Unit], split: bool) -> list[Unit]:
    """Give each parameter declared `tied_across_stages` a unit of its own (when `split`).

    The first stage's embedding and the last stage's output copy then have the same flat
    layout, so their gradient shards can be summed over the embedding group element by element.
    """
    if not split:
        return units
    out = []
    for unit in units:
        tied = [p for p in unit.params if P.is_tied_across_stages(p)]
        if not tied or len(unit.params) == 1:
            out.append(unit)
            continue
        rest = [p for p in unit.params if not P.is_tied_across_stages(p)]
        positions = {id(p): i for i, p in enumerate(unit.params)}
        out.append(Unit(unit.name, rest, unit.modules, _pick(unit.materialize, [positions[id(p)] for p in rest]),
                        unit.chunk, unit.kind))
        for p in tied:
            out.append(Unit(unit.name + ".tied", [p], (), _pick(unit.materialize, [positions[id(p)]]), unit.chunk))
    return out


def _pick(materialize, indices: list[int]):
    if materialize is None:
        return None
    return lambda: [materialize()[i] for i in indices]
