"""How the executor calls a chunk: the module itself (eager), or its captured graphs (--cuda-graph).

The executor (executor.py) runs one step logic for both; only these three calls differ:

    out = calls.forward(c, m, x, labels)      # x: [s, b, h] activation or ids [b, s] (first chunk);
                                              # out: [s, b, h], or the loss sum (a scalar) when labels
                                              # are given (the last model chunk); packed documents add
                                              # position_ids=[b, s] for every chunk, and a last chunk
                                              # that is not the first and reads the tokens (MTP) gets
                                              # input_ids=[b, s]
    grad_in = calls.backward(c, m, grad, deferred)
                                              # grad: the output's gradient [s, b, h], or the loss
                                              # scale on the last chunk; grad_in = d/dx [s, b, h]
                                              # (None on the first chunk, whose input is ids)
    count = calls.weight(c, m)                # ZB-H1's W pass: the weight gradients B left

`ModuleCalls` (eager) keeps for each (c, m) whatever its backward needs (the input, the root of
its autograd graph); `training.pipeline_graphs.PipelineGraphs` replays a graph per call and keeps
its own static tensors.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from megalite.parameters.weight_grad import WeightGradStore, defer_weight_grads


class ChunkCalls(Protocol):
    """What the executor calls in place of a chunk (see the module docstring)."""

    runs_bucket_hooks: bool  # False for replayed graphs: no bucket is launched from a backward hook

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def backward(self, chunk: int, microbatch: int, grad: torch.Tensor | float,
                 deferred: bool = False) -> torch.Tensor | None: ...

    def weight(self, chunk: int, microbatch: int) -> int: ...

    def left_over(self) -> list: ...


class _OutputRoot(torch.autograd.Function):
    """A scalar that stands for a chunk's output as the root of its backward.

    The backward needs the output's graph, not its values (the last op of a chunk, a residual
    add, saves nothing). Rooting the backward at this scalar lets the executor drop the output
    [s, b, h] once it is sent; backward(root) feeds the received gradient, put in `slot`, into
    the output's graph. (Megatron frees the output's .data and calls the autograd engine
    directly to skip its shape check; this stays on public API.)
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, slot: list) -> torch.Tensor:
        ctx.slot = slot
        return output.new_zeros(())

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        return ctx.slot.pop(), None


class ModuleCalls:
    """Eager: chunk c called as a module, its backward run by autograd.

    chunks: this rank's v chunks; a chunk is called as chunk(x), and on the last model chunk as
    chunk(x, labels=..., reduction="sum") returning the loss sum over the microbatch's targets."""

    runs_bucket_hooks = True

    def __init__(self, chunks: list[torch.nn.Module]):
        self.chunks = chunks
        self.store = WeightGradStore()  # ZB-H1: B queues the linear layers' weight gradients, W runs them
        # (c, m) -> (input, root, slot): root is the loss sum (slot None) or an _OutputRoot fed through slot
        self.pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list | None]] = {}

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        documents = {"position_ids": position_ids} if position_ids is not None else {}  # packed documents
        if labels is not None:
            tokens = {"input_ids": input_ids} if input_ids is not None else {}  # MTP on the last stage
            out = self.chunks[chunk](x, labels=labels, reduction="sum", **documents, **tokens)
            if torch.is_grad_enabled():
                self.pending[(chunk, microbatch)] = (x, out, None)
            return out
        out = self.chunks[chunk](x, **documents)
        if torch.is_grad_enabled():  # the root keeps the graph; the output itself can go once sent
            slot: list = []
            self.pending[(chunk, microbatch)] = (x, _OutputRoot.apply(out, slot), slot)
        return out

    def backward(self, chunk: int, microbatch: int, grad: torch.Tensor | float,
                 deferred: bool = False) -> torch.Tensor | None:
        key = (chunk, microbatch)
        x, root, slot = self.pending.pop(key)
        if slot is None:
            root = root * grad  # the loss sum times the loss scale
        else:
            slot.append(grad)
        # ZB-H1's B pass: the chunk's linear layers queue their weight gradients
        with defer_weight_grads(self.store, key, self.chunks[chunk].parameters()) if deferred \
                else contextlib.nullcontext():
            torch.autograd.backward(root)
        return x.grad if x.requires_grad else None

    def weight(self, chunk: int, microbatch: int) -> int:
        """ZB-H1's W pass: the closures B queued, run; returns how many."""
        return self.store.run((chunk, microbatch))

    def left_over(self) -> list:
        return sorted(self.pending) + self.store.pending()
