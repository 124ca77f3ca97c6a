"""Whole matrices for an optimizer that needs them (Muon), from the shards the wrapper keeps.

the blueprint's decision 15: an update that orthogonalises needs each logical matrix whole, while
the data-parallel wrapper keeps it in pieces, a 1/shards piece of each tp shard (ZeRO 1-3). The
wrapper owns where bytes live (decision 7), so it is this module, not the optimizer, that moves
them: `WholeMatrices.apply(values, fn)` takes a shard-sized tensor (one value per element this rank
updates, e.g. Muon's Nesterov momentum), hands each matrix whole to `fn` on its one owner rank,
and returns the shard-sized result, each rank holding its own pieces of fn's outputs again.

A matrix's owner is (zero_rank, tp_rank): in two hops, every byte moving at most twice each way,

    1. ZeRO hop, over the matrix's shard group (dp x cp; expert-dp for experts): every rank sends
       its pieces of the matrix's tp-local tensor to the group's member `zero_rank`, which then
       holds that tp-local tensor whole (one all-to-all per kind of parameter for all matrices);
    2. tp hop, over the tp group of the `zero_rank` members: each tp rank sends its tp-local
       tensor to `tp_rank`, which assembles the full logical tensor (ShardSpec.assemble: fused
       blocks and padding as checkpoints see them). A matrix not split over tp (tp_rank None)
       skips this hop: each tp rank at zero_rank holds it whole and runs fn itself (a replica of
       it: the same numbers on each);

then fn, then the same hops backwards with the result's slices (ShardSpec.shard per tp rank).
At ZeRO 0 (one shard: every dp rank updates everything) the ZeRO hop is empty and every dp
replica's owner computes its copy. The routing tables are built once from the layout (pure
index arithmetic, ``layout.owned_pieces`` of every shard rank), so a step is two all-to-alls
each way per kind of parameter, through megalite.distributed.comm, bytes in the ledger under the groups'
names ("dp"/"dp_cp", "edp", "tp").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.data_parallel.layout import BufferLayout, OwnedPiece


@dataclass(frozen=True)
class MatrixOwner:
    """Where a parameter is assembled whole: member `zero_rank` of its shard group (0 with one shard),
    and there tp rank `tp_rank` (None: the parameter is whole on every tp rank)."""

    zero_rank: int
    tp_rank: int | None


class _ZeroHop:
    """The pieces of one kind of parameter that travel to and from their zero owners (module docstring, 1)."""

    def __init__(self, layout: BufferLayout, kind: int, params: set[int], owners: dict[int, MatrixOwner],
                 me: int, shards: int):
        self.shards, self.me = shards, me

        def pieces_of(rank: int) -> list[OwnedPiece]:
            kinds = 1 + max(b.kind for b in layout.buckets)  # owned_pieces takes one rank per kind in the layout
            ranks = tuple(rank if k == kind else 0 for k in range(max(kinds, kind + 1)))
            return [x for x in layout.owned_pieces(ranks)
                    if x.param in params and layout.buckets[layout.slots[x.param].bucket].kind == kind]

        mine = pieces_of(me)
        # what this rank sends to each member (its own pieces, in shard order) and receives from each
        self.send = [[x for x in mine if owners[x.param].zero_rank == d] for d in range(shards)]
        self.recv = [[x for x in pieces_of(r) if owners[x.param].zero_rank == me] for r in range(shards)] \
            if shards > 1 else [mine]

    def gather(self, values: torch.Tensor, local: dict[int, torch.Tensor], group) -> None:
        """Fill `local[param]` (flat tp-local tensors this rank zero-owns) from every member's pieces."""
        if self.shards == 1:
            for x in self.recv[0]:
                local[x.param][x.local_start:x.local_end] = values[x.shard_start:x.shard_end]
            return
        received = _exchange([[values[x.shard_start:x.shard_end] for x in out] for out in self.send],
                             [sum(x.numel for x in pieces) for pieces in self.recv], group, values)
        offset = 0
        for pieces in self.recv:
            for x in pieces:
                local[x.param][x.local_start:x.local_end] = received[offset:offset + x.numel]
                offset += x.numel

    def scatter(self, local: dict[int, torch.Tensor], out: torch.Tensor, group) -> None:
        """The inverse of `gather`: each member's pieces of the results back into its shard `out`."""
        if self.shards == 1:
            for x in self.recv[0]:
                out[x.shard_start:x.shard_end] = local[x.param][x.local_start:x.local_end]
            return
        received = _exchange([[local[x.param][x.local_start:x.local_end] for x in pieces] for pieces in self.recv],
                             [sum(x.numel for x in pieces) for pieces in self.send], group, out)
        offset = 0
        for pieces in self.send:
            for x in pieces:
                out[x.shard_start:x.shard_end] = received[offset:offset + x.numel]
                offset += x.numel


def _exchange(outgoing: list[list[torch.Tensor]], incoming: list[int], group, like: torch.Tensor) -> torch.Tensor:
    """One variable all-to-all: the concatenation of outgoing[d] goes to member d; incoming[r] elements
    arrive from member r, returned back to back."""
    parts = [t for out in outgoing for t in out]
    send = torch.cat(parts) if parts else like.new_empty(0)
    received = like.new_empty(sum(incoming))
    comm.all_to_all_variable(received, send, incoming, [sum(t.numel() for t in out) for out in outgoing], group)
    return received


class WholeMatrices:
    """Routes the parameters `owners` names (indices into the wrapper's `params`) to their owners and back.

    layout, groups, shard_ranks: the wrapper's (by kind of parameter); tp_group: the mesh's.
    `owners` must be the same dict on every rank of the stage (megalite.plan.muon.assign_owners).
    """

    def __init__(self, *, layout: BufferLayout, params: list[torch.Tensor], groups: tuple, shard_ranks: tuple,
                 tp_group, owners: dict[int, MatrixOwner]):
        self.params, self.owners, self.groups, self.tp_group = params, owners, groups, tp_group
        self.tp_rank, self.tp_size = comm.group_rank(tp_group), comm.group_size(tp_group)
        self.hops: list[_ZeroHop] = []
        for kind, group in enumerate(groups):
            shards = next((b.shard_count for b in layout.buckets if b.kind == kind), 1)
            if shards > 1 and comm.group_size(group) != shards:
                raise ValueError(f"parameters of kind {kind} are in {shards} shards over a group of "
                                 f"{comm.group_size(group)} ranks; whole matrices need the shard group")
            mine = {i for i in owners if layout.buckets[layout.slots[i].bucket].kind == kind}
            self.hops.append(_ZeroHop(layout, kind, mine, owners, shard_ranks[kind] if shards > 1 else 0, shards))
        # the parameters this rank holds whole as tp-local tensors after the ZeRO hop, in index order
        self.zero_owned = sorted({x.param for hop in self.hops for pieces in hop.recv for x in pieces})
        self.tp_split = [i for i in self.zero_owned if owners[i].tp_rank is not None]
        self.whole_here = [i for i in self.zero_owned if owners[i].tp_rank in (None, self.tp_rank)]

    def apply(self, values: torch.Tensor, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """fn(param index, full logical tensor) -> same shape, run once per matrix on its owner; returns
        a tensor like `values` holding this rank's pieces of the results (zero where no matrix is)."""
        local = {i: values.new_zeros(self.params[i].numel()) for i in self.zero_owned}
        for hop, group in zip(self.hops, self.groups):
            hop.gather(values, local, group)
        parts = self._tp_gather(local)
        results = {}
        for i in self.whole_here:
            spec = P.shard_spec(self.params[i])
            if self.owners[i].tp_rank is not None:  # [local...] from every tp rank -> the full tensor
                full = spec.assemble(parts.pop(i))  # the received buffer is freed with its last view
            elif spec.dim is not None:  # one shard of one: only padding (if any) to drop
                full = spec.assemble([local[i].view(spec.local_shape())])
            else:
                full = local[i].view(spec.full_shape)
            results[i] = fn(i, full).to(values.dtype)
            del full
        local = None  # the tp-local inputs are spent: freed before the results travel back
        local = self._tp_scatter(results, values)
        out = torch.zeros_like(values)
        for hop, group in zip(self.hops, self.groups):
            hop.scatter(local, out, group)
        return out

    def _tp_gather(self, local: dict[int, torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """The tp hop: {param this rank assembles: every tp rank's tp-local tensor, by tp rank}."""
        mine = [i for i in self.tp_split if self.owners[i].tp_rank == self.tp_rank]
        if not self.tp_split:
            return {}
        outgoing = [[local[i] for i in self.tp_split if self.owners[i].tp_rank == t] for t in range(self.tp_size)]
        sizes = sum(self.params[i].numel() for i in mine)
        received = _exchange(outgoing, [sizes] * self.tp_size, self.tp_group, next(iter(local.values())))
        parts, offset = {i: [] for i in mine}, 0
        for _ in range(self.tp_size):
            for i in mine:
                n = self.params[i].numel()
                parts[i].append(received[offset:offset + n].view(self.params[i].shape))
                offset += n
        return parts

    def _tp_scatter(self, results: dict[int, torch.Tensor], like: torch.Tensor) -> dict[int, torch.Tensor]:
        """The tp hop backwards: every zero-owned parameter's tp-local slice of its result. Consumes
        `results` (each full result is freed once its slices are cut)."""
        out = {}
        for i in self.zero_owned:
            if self.owners[i].tp_rank is None:
                spec, full = P.shard_spec(self.params[i]), results.pop(i)
                out[i] = (spec.shard(full) if spec.dim is not None else full).reshape(-1)
        if not self.tp_split:
            return out
        mine = [i for i in self.tp_split if self.owners[i].tp_rank == self.tp_rank]
        outgoing = [[] for _ in range(self.tp_size)]
        for i in mine:
            full = results.pop(i)
            for t in range(self.tp_size):
                outgoing[t].append(replace(P.shard_spec(self.params[i]), tp_rank=t).shard(full).reshape(-1))
            full = None
        incoming = [sum(self.params[i].numel() for i in self.tp_split if self.owners[i].tp_rank == t)
                    for t in range(self.tp_size)]
        received = _exchange(outgoing, incoming, self.tp_group, like)
        offset = 0
        for t in range(self.tp_size):
            for i in self.tp_split:
                if self.owners[i].tp_rank == t:
                    n = self.params[i].numel()
                    out[i] = received[offset:offset + n]
                    offset += n
        return out

