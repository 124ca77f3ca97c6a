"""One executor for every schedule: walk this stage's instructions and do them.

Per (chunk, microbatch) the executor keeps, only as long as an instruction still needs it:
  inputs[c, m]        received activation (leaf, requires grad) or the input ids
  outputs[c, m]       the chunk's output until it is sent (the last chunk's loss sum is added up
                      at once; its backward root stays with the chunk calls)
  output_grads[c, m]  the received gradient w.r.t. the chunk's output
  input_grads[c, m]   inputs[c, m].grad, kept until it is sent
Under DualPipeV's V placement rank pp-1 holds two consecutive model chunks (pp-1 and pp): the
first's output goes to the second as its input in memory (detached, a leaf like a received
activation), and the second's input gradient goes back as the first's output gradient, with no
transfer (p2p.is_local_hop).
Everything is popped by its last consumer, so a microbatch's activations are freed by its
backward (BWD), or by its weight pass (BWD_WEIGHT) under zero-bubble schedules, whose
deferred weight-gradient work holds the layer inputs until then. A sent output [s, b, h] is
freed at once, not kept until its backward: on stage 0 of 1F1B that is pp of them.

The chunk calls are the one place eager and --cuda-graph steps differ (chunk_calls.py): a
chunk's forward, backward and weight pass are either the module and autograd (`ModuleCalls`,
which keeps the root of each microbatch's backward) or its captured graphs replayed.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from megalite.distributed import comm
from megalite.parameters import params
from megalite.distributed.mesh import Mesh
from megalite.pipeline import p2p
from megalite.pipeline.chunk_calls import ChunkCalls, ModuleCalls
from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, SEND_ACT, SEND_GRAD, Instr, split_steps
from megalite.pipeline.partition import ChunkPlacement
from megalite.pipeline.schedules import ScheduleName, chunk_placement, schedule_name, verified_schedule
from megalite.distributed.host_reads import no_host_reads


@dataclass(frozen=True)
class PipelineSpec:
    """What every rank of a pipeline agrees on before running a step.

    schedule: one of `schedules.SCHEDULES` (a string as a user types it is kept as the enum); num_microbatches per step (and dp rank);
    virtual_stages: model chunks per rank; activation_shape, dtype: what crosses every chunk
    boundary (e.g. [s, b, h], or [s/tp, b, h] under sequence parallelism): receive buffers are
    allocated from them, so no shape handshake is needed.
    """

    schedule: ScheduleName
    num_microbatches: int
    activation_shape: tuple[int, ...]
    dtype: torch.dtype
    virtual_stages: int = 1

    def __post_init__(self):
        object.__setattr__(self, "schedule", schedule_name(self.schedule))


class GradSync(Protocol):
    """What a data-parallel wrapper offers the executor (megalite.data_parallel.DataParallel)."""

    def before_last_backward(self, chunk: int) -> None:
        """Called right before local chunk `chunk`'s last gradient-producing instruction."""

    def reduces_tied_grads(self) -> bool:
        """True when the wrapper sums the tied embedding's gradient over the embedding group itself."""

    # optional: after_weight_grads(chunk) runs after each zero-bubble W pass of local chunk `chunk`


def post_and_wait(transfers: Iterable[tuple[str, torch.Tensor, int]], group) -> None:
    """Post ('send'|'recv', tensor, peer global rank) transfers as one batch and wait for all.

    Every op of the batch is in flight at once, so a send and a receive with the same peer
    (or with both neighbours) cannot deadlock against each other. Waiting only blocks the
    host on these handles (on CUDA the communication stream), never the whole device.
    """
    ops = [comm.P2P(op, tensor, peer_rank) for op, tensor, peer_rank in transfers]
    if ops:
        comm.wait_all(comm.batch_isend_irecv(ops, group))


def allreduce_shared_embedding_grads(model_chunks: list[torch.nn.Module], mesh: Mesh) -> None:
    """Sum the `.grad` of tied-across-stages parameters over `mesh.embedding_group`.

    The first stage's input embedding and the last stage's output weight are one tied weight
    held twice (GPT-2); summing both grads on both copies keeps them identical after the
    optimizer step. Both ends must declare the same number of tied parameters, in the same
    order. No-op with pp == 1, where the tie is one local Parameter. (A data-parallel wrapper
    does this on its own fp32 main grads instead; see GradSync.)
    """
    if mesh.pp_size == 1 or mesh.embedding_group is None:
        return
    for chunk in model_chunks:
        for param in chunk.parameters():
            if params.is_tied_across_stages(param):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                comm.all_reduce(param.grad, mesh.embedding_group)


def run_pipeline(spec: PipelineSpec, model_chunks: list[torch.nn.Module], microbatches: list[dict[str, Any]],
                 mesh: Mesh, loss_scale: float | torch.Tensor | Callable[[], Any] = 1.0, *,
                 forward_only: bool = False, grad_sync: GradSync | None = None,
                 stats: dict[str, Any] | None = None, check_host_reads: bool = False,
                 graphs: ChunkCalls | None = None) -> float:
    """Run forward and backward of every microbatch on this rank under `spec.schedule`.

    model_chunks: this rank's v chunks, local chunk c = model chunk c*pp + pp_rank (under DualPipeV
      model chunks pp_rank and 2pp-1-pp_rank: partition.stage_layers with its placement). A chunk
      is called as chunk(x) and, on the last model chunk, chunk(x, labels=..., reduction="sum")
      returning the loss SUM over the microbatch's target tokens.
    microbatches: the same list on every rank, each {"input_ids": [b, s], "labels": [b, s]};
      only the first and last model chunk read it.
    loss_scale: the executor backpropagates loss_sum * loss_scale (e.g. 1 / global target
      tokens); a callable is called once, at the first backward of a loss (so a token count
      still being all-reduced is waited for only then).
    forward_only: evaluation. Forwards and activation transfers only, under no_grad; each
      output is freed once sent; no gradients, no embedding all-reduce.
    grad_sync: a data-parallel wrapper; its before_last_backward(c) runs right before chunk c's
      last gradient-producing instruction (its last BWD, or BWD_WEIGHT under zero-bubble), so
      the chunk's buckets reduce during it. Without one, tied-embedding `.grad`s are summed
      over the embedding group at the end.
    stats: if given, filled with "peak_live_microbatches" (most (chunk, microbatch) pairs
      whose activations were alive at once on this rank), "instructions",
      "deferred_weight_grads" (weight-gradient closures run by BWD_WEIGHT) and
      "transfer_wait_s" (host seconds in activation/gradient transfers: mostly waiting for a
      neighbour stage) and "compute_s" ({instruction kind: median host seconds of one, so an
      instruction descheduled on a busy host does not count}, for `replay.replay_bubble`).
    check_host_reads: the schedule's forwards, backwards and transfers run under
      `host_reads.no_host_reads()` (a tensor value read into Python raises).
    graphs: the chunk calls in place of the modules (`chunk_calls.ChunkCalls`; --cuda-graph's
      `training.pipeline_graphs.PipelineGraphs`): each chunk's forward and backward are its
      captured graphs, replayed (captured where the first step first runs them), with no
      autograd across the chunk boundary. The step logic is the same; grad_sync's
      before_last_backward is then not called (a replay runs no bucket hooks; every bucket is
      reduced after the step).
    Returns the sum of the unscaled loss sums on the stage holding the last model chunk (the last
    stage; stage 0 under DualPipeV), 0.0 elsewhere.
    """
    if len(model_chunks) != spec.virtual_stages:
        raise ValueError(f"got {len(model_chunks)} model chunks but virtual_stages={spec.virtual_stages}; build "
                         f"one chunk per virtual stage (partition.stage_layers gives their layers)")
    if len(microbatches) != spec.num_microbatches:
        raise ValueError(f"got {len(microbatches)} microbatches but num_microbatches={spec.num_microbatches}")
    if forward_only and graphs is not None:
        raise ValueError("graphs replay training steps (forward and backward); evaluate without them")
    if graphs is not None and chunk_placement(spec.schedule) != ChunkPlacement.INTERLEAVED:
        raise ValueError("captured chunk graphs do not hold DualPipeV's in-memory hop between a rank's chunks yet; "
                         "run it eagerly (graphs=None) or choose another schedule")
    executor = _Executor(spec, model_chunks, microbatches, mesh, loss_scale, forward_only, graphs)
    with no_host_reads() if check_host_reads else contextlib.nullcontext():
        executor.run(grad_sync)
    if not forward_only and (grad_sync is None or not grad_sync.reduces_tied_grads()):
        allreduce_shared_embedding_grads(model_chunks, mesh)
    if stats is not None:
        stats.update(executor.stats())
    return executor.loss_sum()


class _Executor:
    """One step of one stage: walks the verified instruction list and keeps per (chunk,
    microbatch) only what a later instruction still needs (see the module docstring)."""

    def __init__(self, spec: PipelineSpec, chunks, microbatches, mesh: Mesh, loss_scale, forward_only: bool,
                 graphs: ChunkCalls | None = None):
        self.spec, self.microbatches, self.mesh = spec, microbatches, mesh
        self.calls: ChunkCalls = graphs if graphs is not None else ModuleCalls(chunks)
        self.forward_only, self._loss_scale = forward_only, loss_scale
        self.pp, self.stage, self.v = mesh.pp_size, mesh.pp_rank, spec.virtual_stages
        self.placement = chunk_placement(spec.schedule)
        # a last chunk that embeds the tokens ahead (DeepSeek's MTP) is handed the microbatch's ids too
        self.last_reads_ids = bool(getattr(chunks[-1], "mtp_on_last_stage", False))
        self.ops = verified_schedule(spec.schedule, self.pp, spec.num_microbatches, self.v, forward_only)[self.stage]
        self.shape = torch.Size(spec.activation_shape)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.output_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.live: set[tuple[int, int]] = set()
        self.peak_live = self.deferred_weight_grads = 0
        self.transfer_wait_s = 0.0
        self.compute_seconds: dict[str, list[float]] = {}  # kind -> seconds of each instruction of that kind
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=mesh.device)  # see train_step

    def run(self, grad_sync: GradSync | None) -> None:
        # Each chunk's last gradient-producing instruction (weight grads come last); each is unique.
        last_grad_op = {op.chunk: op for op in self.ops if op.kind in (BWD, BWD_WEIGHT)}
        with torch.no_grad() if self.forward_only else torch.enable_grad():
            for step in split_steps(list(self.ops)):
                op = step[0]
                if grad_sync is not None and self.calls.runs_bucket_hooks and last_grad_op.get(op.chunk) == op:
                    grad_sync.before_last_backward(op.chunk)
                if op.is_transfer:
                    self.transfer(step)
                else:
                    start = time.perf_counter()
                    self.compute(op, grad_sync)
                    self.compute_seconds.setdefault(op.kind, []).append(time.perf_counter() - start)
        left_over = self.calls.left_over()
        if self.outputs or self.inputs or self.output_grads or self.input_grads or left_over:
            raise RuntimeError(f"pipeline ended with state left over on stage {self.stage}: outputs "
                               f"{sorted(self.outputs)}, inputs {sorted(self.inputs)}, in the chunk calls "
                               f"(backward roots, pending weight grads) {left_over}")

    def compute(self, op: Instr, grad_sync: GradSync | None) -> None:
        if op.kind == FWD:
            self.forward(op.chunk, op.microbatch)
        elif op.kind in (BWD, BWD_INPUT):
            self.backward(op.chunk, op.microbatch, deferred=op.kind == BWD_INPUT)
        elif op.kind == BWD_WEIGHT:
            self.deferred_weight_grads += self.calls.weight(op.chunk, op.microbatch)
            self.live.discard((op.chunk, op.microbatch))
            if grad_sync is not None and hasattr(grad_sync, "after_weight_grads"):
                grad_sync.after_weight_grads(op.chunk)  # ZeRO-3 reduces the delivered weight grads
        else:
            raise ValueError(f"unknown instruction {op}")

    def transfer(self, batch: list[Instr]) -> None:
        transfers, received = [], []
        for op in batch:
            key = (op.chunk, op.microbatch)
            peer_rank = self.mesh.pp_ranks[p2p.peer(op.kind, self.pp, self.v, self.stage, op.chunk, self.placement)[0]]
            if op.kind == SEND_ACT:
                transfers.append(("send", self._checked_output(op.chunk, key).detach().contiguous(), peer_rank))
            elif op.kind == SEND_GRAD:
                transfers.append(("send", self.input_grads.pop(key).contiguous(), peer_rank))
            else:
                buffer = torch.empty(self.shape, dtype=self.spec.dtype, device=self.mesh.device)
                (self.inputs if op.kind == RECV_ACT else self.output_grads)[key] = buffer
                transfers.append(("recv", buffer, peer_rank))
                received.append((op.kind, buffer))
        start = time.perf_counter()
        post_and_wait(transfers, self.mesh.pp_group)
        self.transfer_wait_s += time.perf_counter() - start
        for kind, buffer in received:
            if kind == RECV_ACT and not self.forward_only:
                buffer.requires_grad_(True)
        for op in batch:  # a sent output is done: the backward starts from its root
            if op.kind == SEND_ACT:
                del self.outputs[(op.chunk, op.microbatch)]
                if self.forward_only:
                    self.live.discard((op.chunk, op.microbatch))

    def _checked_output(self, chunk: int, key: tuple[int, int]) -> torch.Tensor:
        out = self.outputs[key]
        if out.shape != self.shape or out.dtype != self.spec.dtype:
            raise ValueError(f"chunk {chunk} produced {tuple(out.shape)} {out.dtype} but the pipeline carries "
                             f"activation_shape={tuple(self.shape)} {self.spec.dtype}; pass the shape of the "
                             f"hidden states between stages")
        return out

    def _scale(self):
        if callable(self._loss_scale):
            self._loss_scale = self._loss_scale()  # resolved once, at the first loss
        return self._loss_scale

    def forward(self, c: int, mb: int) -> None:
        """FWD(c, mb): the chunk's output kept until sent; on the last chunk the loss sum added up
        (its backward root stays with the chunk calls)."""
        key = (c, mb)
        if p2p.is_first_chunk(self.pp, self.stage, c):
            self.inputs[key] = self.microbatches[mb]["input_ids"].to(self.mesh.device)
        elif self._local_hop(RECV_ACT, c):  # the V's turn: the previous local chunk's output, in memory
            before = (p2p.peer(RECV_ACT, self.pp, self.v, self.stage, c, self.placement)[1], mb)
            self.inputs[key] = self._checked_output(before[0], before).detach()
            del self.outputs[before]
            if self.forward_only:
                self.live.discard(before)
            else:
                self.inputs[key].requires_grad_(True)
        # packed documents: every chunk builds its blocks' mask from the microbatch's position ids
        documents = {"position_ids": self.microbatches[mb]["position_ids"].to(self.mesh.device)} \
            if "position_ids" in self.microbatches[mb] else {}
        if p2p.is_last_chunk(self.pp, self.v, self.stage, c, self.placement):
            labels = self.microbatches[mb]["labels"].to(self.mesh.device)
            if self.last_reads_ids and not p2p.is_first_chunk(self.pp, self.stage, c):
                documents["input_ids"] = self.microbatches[mb]["input_ids"].to(self.mesh.device)
            loss = self.calls.forward(c, mb, self.inputs[key], labels, **documents)
            self._loss_sum = self._loss_sum + loss.detach().double()
            if self.forward_only:
                self.inputs.pop(key)
                return
        else:
            self.outputs[key] = self.calls.forward(c, mb, self.inputs[key], **documents)
            if self.forward_only:
                self.inputs.pop(key)
        self.live.add(key)
        self.peak_live = max(self.peak_live, len(self.live))

    def backward(self, c: int, mb: int, deferred: bool) -> None:
        """BWD(c, mb), or ZB-H1's B pass (deferred: the linear layers' weight gradients wait for W):
        from the received output gradient (the loss scale on the last chunk) to the input's, kept to send."""
        key = (c, mb)
        last = p2p.is_last_chunk(self.pp, self.v, self.stage, c, self.placement)
        input_grad = self.calls.backward(c, mb, self._scale() if last else self.output_grads.pop(key), deferred)
        self.inputs.pop(key)
        if not p2p.is_first_chunk(self.pp, self.stage, c):
            if input_grad is None:
                raise RuntimeError(f"chunk {c} microbatch {mb}: the input activation got no gradient; the chunk's "
                                   f"output must depend on its input")
            if self._local_hop(SEND_GRAD, c):  # the V's turn: the previous local chunk's output gradient
                before = p2p.peer(SEND_GRAD, self.pp, self.v, self.stage, c, self.placement)[1]
                self.output_grads[(before, mb)] = input_grad
            else:
                self.input_grads[key] = input_grad
        if not deferred:  # ZB-H1's B: the microbatch stays live until its W
            self.live.discard(key)

    def _local_hop(self, kind: str, chunk: int) -> bool:
        return p2p.is_local_hop(kind, self.pp, self.v, self.stage, chunk, self.placement)

    def loss_sum(self) -> float:
        last = p2p.last_chunk_location(self.pp, self.v, self.placement)
        return float(self._loss_sum) if self.stage == last[0] else 0.0

    def stats(self) -> dict[str, Any]:
        return {"peak_live_microbatches": self.peak_live, "instructions": len(self.ops),
                "deferred_weight_grads": self.deferred_weight_grads, "transfer_wait_s": self.transfer_wait_s,
                "compute_s": {kind: statistics.median(seconds) for kind, seconds in self.compute_seconds.items()}}
