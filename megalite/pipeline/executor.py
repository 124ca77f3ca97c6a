"""One executor for every schedule: walk this stage's instructions and do them.

Per (chunk, microbatch) the executor keeps, only as long as an instruction still needs it:
  inputs[c, m]        received activation (leaf, requires grad) or the input ids
  outputs[c, m]       the chunk's output until it is sent, or the scaled loss (last chunk)
  roots[c, m]         a scalar standing for a sent output in autograd (see _OutputRoot)
  output_grads[c, m]  the received gradient w.r.t. the chunk's output
  input_grads[c, m]   inputs[c, m].grad, kept until it is sent
Everything is popped by its last consumer, so a microbatch's activations are freed by its
backward (BWD), or by its weight pass (BWD_WEIGHT) under zero-bubble schedules, whose
deferred weight-gradient work holds the layer inputs until then. A sent output [s, b, h] is
freed at once, not kept until its backward: on stage 0 of 1F1B that is pp of them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from megalite import comm
from megalite.mesh import Mesh
from megalite.pipeline import p2p
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, SEND_ACT, SEND_GRAD, Instr,
                                            split_steps)
from megalite.pipeline.partition import chunk_layer_counts
from megalite.pipeline.schedules import build_schedule
from megalite.pipeline.verifier import verify_schedule
from megalite.tensor_parallel.weight_grad import WeightGradStore, defer_weight_grads


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


@functools.lru_cache(maxsize=32)
def verified_schedule(name: str, pp: int, num_microbatches: int, v: int = 1,
                      forward_only: bool = False) -> tuple[tuple[Instr, ...], ...]:
    """build_schedule + verify_schedule, once per process and configuration."""
    schedule = build_schedule(name, pp, num_microbatches, v, forward_only)
    verify_schedule(schedule, pp, v, num_microbatches, forward_only)
    return tuple(tuple(ops) for ops in schedule)


def check_pipeline_config(schedule_name: str, num_layers: int, pp: int, num_microbatches: int, v: int = 1,
                          first: int | None = None, last: int | None = None, layout=None) -> None:
    """Validate a pipeline configuration before any process group exists (for start-up checks).

    Raises ValueError naming the fix: more stages than layers, layers not divisible without a
    layout, interleaved with microbatches not a multiple of pp, ... Then builds and verifies
    the schedule once (cached), so a broken schedule fails here rather than hanging later.
    """
    chunk_layer_counts(num_layers, pp, v, first, last, layout)
    verified_schedule(schedule_name, pp, num_microbatches, v)


def allreduce_shared_embedding_grads(model_chunks: list[torch.nn.Module], mesh: Mesh) -> None:
    """Sum the grads of parameters marked `shared_embedding=True` over `mesh.embedding_group`.

    The first stage's input embedding and the last stage's output weight are one tied
    weight held twice (GPT-2); summing both grads on both copies keeps them identical after
    the optimizer step. Uses `param.main_grad` when a data-parallel engine keeps one. Both
    ends must mark the same number of parameters, in the same order. No-op with pp == 1,
    where the tie is one local Parameter.
    """
    if mesh.pp_size == 1 or mesh.embedding_group is None:
        return
    for chunk in model_chunks:
        for param in chunk.parameters():
            if not getattr(param, "shared_embedding", False):
                continue
            grad = getattr(param, "main_grad", None)
            if grad is None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            comm.all_reduce(grad, mesh.embedding_group)


def run_pipeline(schedule_name: str, model_chunks: list[torch.nn.Module], microbatches: list[dict[str, Any]],
                 mesh: Mesh, num_microbatches: int, activation_shape: tuple[int, ...] | torch.Size,
                 dtype: torch.dtype, loss_scale: float, virtual_stages: int = 1,
                 stats: dict[str, Any] | None = None, forward_only: bool = False,
                 before_last_backward: Callable[[int], None] | None = None) -> float:
    """Run forward and backward of every microbatch on this rank under `schedule_name`.

    model_chunks: this rank's v chunks, local chunk c = model chunk c*pp + pp_rank. A chunk
      is called as chunk(x) and, on the last model chunk, chunk(x, labels=..., reduction="sum")
      returning the loss SUM over the microbatch's target tokens.
    microbatches: the same list on every rank, each {"input_ids": [b, s], "labels": [b, s]};
      only the first and last model chunk read it.
    activation_shape, dtype: what every chunk boundary carries (e.g. [s, b, h]); receive
      buffers are allocated from them, so no shape handshake is needed.
    loss_scale: the executor backpropagates loss_sum * loss_scale (1 / global target tokens).
    stats: if given, filled with "peak_live_microbatches" (most (chunk, microbatch) pairs
      whose activations were alive at once on this rank), "instructions" and
      "deferred_weight_grads" (weight-gradient closures run by BWD_WEIGHT).
    forward_only: evaluation. Forwards and activation transfers only, under no_grad; each
      output is freed once sent; no gradients, no embedding all-reduce.
    before_last_backward: called with a local chunk index right before that chunk's last
      gradient-producing instruction (its last BWD, or BWD_WEIGHT under zero-bubble), so a
      data-parallel engine can reduce the chunk's buckets during it instead of after the step.
    Returns the sum of the unscaled loss sums on the last stage, 0.0 elsewhere. Grads of
    `shared_embedding` parameters are all-reduced over the embedding group at the end.
    """
    pp, stage, v = mesh.pp_size, mesh.pp_rank, virtual_stages
    if len(model_chunks) != v:
        raise ValueError(f"got {len(model_chunks)} model chunks but virtual_stages={v}; build one chunk per "
                         f"virtual stage (partition.stage_layers gives their layers)")
    if len(microbatches) != num_microbatches:
        raise ValueError(f"got {len(microbatches)} microbatches but num_microbatches={num_microbatches}")
    ops = verified_schedule(schedule_name, pp, num_microbatches, v, forward_only)[stage]
    activation_shape = torch.Size(activation_shape)
    device = mesh.device

    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    roots: dict[tuple[int, int], tuple[torch.Tensor, list]] = {}
    output_grads: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[tuple[int, int], torch.Tensor] = {}
    store = WeightGradStore()
    live: set[tuple[int, int]] = set()
    peak_live = 0
    deferred_weight_grads = 0
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)

    def transfer(batch: list[Instr]) -> None:
        transfers, received = [], []
        for op in batch:
            key = (op.chunk, op.microbatch)
            peer_rank = mesh.pp_ranks[p2p.peer(op.kind, pp, v, stage, op.chunk)[0]]
            if op.kind == SEND_ACT:
                out = outputs[key]
                if out.shape != activation_shape or out.dtype != dtype:
                    raise ValueError(f"chunk {op.chunk} produced {tuple(out.shape)} {out.dtype} but the pipeline "
                                     f"carries activation_shape={tuple(activation_shape)} {dtype}; pass the shape "
                                     f"of the hidden states between stages")
                transfers.append(("send", out.detach().contiguous(), peer_rank))
            elif op.kind == SEND_GRAD:
                transfers.append(("send", input_grads.pop(key).contiguous(), peer_rank))
            else:
                buffer = torch.empty(activation_shape, dtype=dtype, device=device)
                (inputs if op.kind == RECV_ACT else output_grads)[key] = buffer
                transfers.append(("recv", buffer, peer_rank))
                received.append((op.kind, buffer))
        p2p.post_and_wait(transfers, mesh.pp_group)
        for kind, buffer in received:
            if kind == RECV_ACT and not forward_only:
                buffer.requires_grad_(True)
        for op in batch:  # a sent output is done: the backward starts from its root
            if op.kind == SEND_ACT:
                del outputs[(op.chunk, op.microbatch)]
                if forward_only:
                    live.discard((op.chunk, op.microbatch))

    def forward(c: int, mb: int) -> None:
        nonlocal loss_sum, peak_live
        key = (c, mb)
        if p2p.is_first_chunk(pp, stage, c):
            inputs[key] = microbatches[mb]["input_ids"].to(device)
        x = inputs[key]
        if p2p.is_last_chunk(pp, v, stage, c):
            loss = model_chunks[c](x, labels=microbatches[mb]["labels"].to(device), reduction="sum")
            loss_sum = loss_sum + loss.detach().float()
            if forward_only:
                inputs.pop(key)
                return
            outputs[key] = loss * loss_scale
        else:
            outputs[key] = model_chunks[c](x)
            if not forward_only:
                slot: list = []
                roots[key] = (_OutputRoot.apply(outputs[key], slot), slot)
        if forward_only:
            inputs.pop(key)
        live.add(key)
        peak_live = max(peak_live, len(live))

    def backward(c: int, mb: int, deferred: bool) -> None:
        key = (c, mb)
        if p2p.is_last_chunk(pp, v, stage, c):
            root = outputs.pop(key)  # the scaled loss
        else:
            root, slot = roots.pop(key)
            slot.append(output_grads.pop(key))
        if deferred:
            with defer_weight_grads(store, key):
                torch.autograd.backward(root)
        else:
            torch.autograd.backward(root)
        x = inputs.pop(key)
        if not p2p.is_first_chunk(pp, stage, c):
            if x.grad is None:
                raise RuntimeError(f"chunk {c} microbatch {mb}: the input activation got no gradient; the chunk's "
                                   f"output must depend on its input")
            input_grads[key] = x.grad
        if not deferred:
            live.discard(key)

    # Index of each chunk's last gradient-producing instruction (weight grads come last).
    last_grad_op = {op.chunk: op for op in ops if op.kind in (BWD, BWD_WEIGHT)}  # each is unique
    with torch.no_grad() if forward_only else torch.enable_grad():
        for step in split_steps(list(ops)):
            op = step[0]
            if before_last_backward is not None and last_grad_op.get(op.chunk) == op:
                before_last_backward(op.chunk)
            if op.is_transfer:
                transfer(step)
            elif op.kind == FWD:
                forward(op.chunk, op.microbatch)
            elif op.kind in (BWD, BWD_INPUT):
                backward(op.chunk, op.microbatch, deferred=op.kind == BWD_INPUT)
            elif op.kind == BWD_WEIGHT:
                deferred_weight_grads += store.run((op.chunk, op.microbatch))
                live.discard((op.chunk, op.microbatch))
            else:
                raise ValueError(f"unknown instruction {op}")
    if outputs or roots or inputs or output_grads or input_grads or store.pending():
        raise RuntimeError(f"pipeline ended with state left over on stage {stage}: outputs {sorted(outputs)}, "
                           f"inputs {sorted(inputs)}, pending weight grads {store.pending()}")
    if not forward_only:
        allreduce_shared_embedding_grads(model_chunks, mesh)
    if stats is not None:
        stats["peak_live_microbatches"] = peak_live
        stats["instructions"] = len(ops)
        stats["deferred_weight_grads"] = deferred_weight_grads
    return float(loss_sum) if p2p.is_last_chunk(pp, v, stage, v - 1) else 0.0
