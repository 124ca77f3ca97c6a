"""--cuda-graph at pp > 1: each (chunk, microbatch)'s forward and backward captured as two graphs.

At pp = 1 (`cuda_graph.StepGraphs`) one graph holds a microbatch's whole forward and backward.
A pipeline stage cannot: between the forward and the backward of local chunk c on microbatch m
the schedule sends the output, runs other microbatches and receives the output's gradient. So
each (c, m) slot gets two graphs, and the executor's transfers stay outside both, as eager:

    forward graph   static x ----------------------> static out
                    x: [s, b, h] activation (a leaf that requires grad), or ids [b, s] int64 on
                    the first model chunk (+ static labels [b, s] on the last one, whose `out`
                    is the loss sum, an fp32 scalar); out: [s, b, h]
    backward graph  static grad_out ---------------> static grad_in = x.grad [s, b, h]
                    grad_out: the received gradient of out [s, b, h], or on the last chunk the
                    loss scale (d(loss * scale)/d loss = scale, so the scale is an input of the
                    backward, not a constant of either graph); grad_in: none on the first chunk;
                    parameter gradients += into the DP wrapper's fp32 main-grad buffers

`PipelineGraphs.forward(c, m, x)` copies x into the slot's static x, replays, returns the static
out; `backward(c, m, grad)` copies grad in, replays, returns the static grad_in. The executor
(`run_pipeline(..., graphs=...)`) calls them in place of the chunk and of autograd: no autograd
graph spans a chunk boundary, so nothing is captured inside the autograd engine's own threads
(the backward graph is captured on the host thread at the schedule's BWD(c, m), not from an
autograd.Function's backward, a reentrant backward) and the executor's sends and receives are
exactly the eager ones. What a slot returns aliases its static tensors: the executor sends out
and grad_in before the same slot replays again (the next step).

Capture order is replay order. Every graph draws on one memory pool: a graph's temporaries, and
a forward's saved activations once its backward is captured (autograd frees them), return to the
pool, and a later capture may place its own tensors there. That is safe only if every later step
replays the graphs in the order they were captured, so a block is overwritten only after its last
reader ran. The first step captures each graph where the schedule first runs it (forward at
FWD(c, m), backward at BWD(c, m); capture, then replay at once), so the capture order IS that
step's schedule order, and every step walks the same verified schedule: 1F1B's F0 F1 B0 F2 B1 ...
replays as it was captured, and slot (c, m)'s activations stay untouched from its forward to its
backward however many other slots run between, exactly the blocks the eager schedule keeps alive.
Hence a step with another schedule, microbatch count or activation shape is refused
(`begin_step`), never captured beside the old graphs. Memory: about the eager peak, plus per slot
its four static [s, b, h] tensors (x, out, grad_out, grad_in) for the whole run.

Warm-up (first step, before any capture; as at pp = 1): each local chunk runs forward and backward
WARMUP_ITERATIONS times on a side stream, under `host_reads.no_host_reads()`, on stand-in inputs
of the static shapes; their gradients are discarded (`zero_grad`) before the schedule starts.

Bucket bookkeeping: as at pp = 1, the graphed backwards accumulate with synchronisation off (the
executor does not call `before_last_backward`: a bucket launched from a hook at capture would be
a collective inside the graph, and a replay runs no hooks); `finish_reduction` launches every
bucket after the step, the tied embedding's sum over its two stages included.

ZB-H1 splits the backward: its B pass queues each linear layer's weight-gradient closure on the
host (weight_grad.py) and its W pass runs them. A replayed B queues nothing, so W
is a third graph per slot, `weight(c, m)`: captured at the first step's W(c, m) from the closures
B's capture queued (`self.store`), which hold the layer inputs and output gradients W reads until
then (in the pool, as they stay alive in the eager schedule), replayed at every later W(c, m).

On CPU the tests stand in a "graph" that re-runs the captured Python (the capture's own run
standing for the capture plus the first replay): they prove the plumbing (static buffers, copy
in and out, the backward wiring, the accumulation, the W graphs, each graph captured once and
replayed every step), not the CUDA side (the pool shared in capture order, replays writing to
the captured addresses, captures beside NCCL transfers), which only a GPU run at pp > 1 can check.
"""
from __future__ import annotations

import contextlib

import torch

from megalite.config.choices import Schedule
from megalite.errors import UsageError
from megalite.pipeline import p2p
from megalite.parameters.weight_grad import WeightGradStore, defer_weight_grads
from megalite.training import cuda_graph
from megalite.distributed.host_reads import HostReadError, no_host_reads


class _ChunkSlot:
    """Local chunk c on microbatch m: its two graphs and the static tensors they read and write."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor | None):
        self.x, self.labels = x, labels  # static inputs of the forward graph
        self.forward_graph = self.backward_graph = self.weight_graph = None  # weight_graph: ZB-H1's W
        self.weight_closures = 0  # the weight-gradient closures the W graph holds (as an eager W runs them)
        self.root: torch.Tensor | None = None  # the captured forward's output, the root of its backward
        self.out: torch.Tensor | None = None  # static output of the forward graph
        self.grad_out: torch.Tensor | None = None  # static input of the backward graph
        self.grad_in: torch.Tensor | None = None  # static output of the backward graph (x.grad)


def _same_shape(what: str, given: torch.Tensor, static: torch.Tensor) -> None:
    if given.shape != static.shape:
        raise ValueError(f"--cuda-graph: {what} has shape {tuple(given.shape)} but the graph was captured for "
                         f"{tuple(static.shape)}; shapes must be static (drop --cuda-graph)")


class PipelineGraphs:
    """This stage's captured (chunk, microbatch) slots (see the module docstring): the executor's chunk
    calls (`pipeline.chunk_calls.ChunkCalls`) as graph replays.

    model: the DataParallel wrapper holding this rank's v chunks; mesh: its mesh (which chunk is
    the model's first and last)."""

    runs_bucket_hooks = False  # a replay runs no backward hooks: every bucket is reduced after the step

    def __init__(self, model, mesh):
        if not torch.cuda.is_available():
            raise UsageError("--cuda-graph needs a CUDA GPU and none is visible here; drop --cuda-graph")
        self.model, self.mesh = model, mesh
        self.pool = torch.cuda.graph_pool_handle()
        self.slots: dict[tuple[int, int], _ChunkSlot] = {}
        self.spec = None  # the pipeline the slots were captured for
        self.store = WeightGradStore()  # ZB-H1: the B captures queue here what the W captures run

    def check_shapes(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """UsageError, before the step communicates, when its microbatches are not the captured ones'."""
        if self.spec is None:
            return
        shapes = {tuple(mb["input_ids"].shape) for mb in microbatches}
        if len(microbatches) != self.spec.num_microbatches or shapes != {self._input_shape}:
            raise UsageError(f"--cuda-graph: this step has {len(microbatches)} microbatches of input_ids "
                             f"{sorted(shapes)}, the captured pipeline {self.spec.num_microbatches} of "
                             f"{self._input_shape}; keep shapes and batch sizes static or drop --cuda-graph")

    def begin_step(self, spec, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """Before run_pipeline: the first step warms every chunk up; later steps must run the same pipeline."""
        if self.spec is None:
            self._warm_up(spec, microbatches[0])
            self.spec, self._input_shape = spec, tuple(microbatches[0]["input_ids"].shape)
        elif spec != self.spec:
            raise ValueError(f"--cuda-graph: this step's pipeline ({spec.schedule}, {spec.num_microbatches} "
                             f"microbatches, activations {tuple(spec.activation_shape)}) is not the captured one "
                             f"({self.spec.schedule}, {self.spec.num_microbatches}, "
                             f"{tuple(self.spec.activation_shape)}): graphs replay in their capture order only; "
                             f"keep shapes and batch sizes static (or drop --cuda-graph)")

    # ------------------------------------------------------------------ what the executor calls

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk's output [s, b, h] (or the loss sum on the last chunk): its forward graph replayed.
        Packed documents (position_ids) are not captured: --cuda-graph refuses --reset-attention-mask."""
        if position_ids is not None:
            raise ValueError("--cuda-graph does not capture packed documents (position_ids); drop one of them")
        slot = self.slots.get((chunk, microbatch))
        if slot is None:  # first step: captured here, in schedule order
            slot = self.slots[(chunk, microbatch)] = self._capture_forward(chunk, x, labels)
        else:
            _same_shape("the chunk input", x, slot.x)
            if labels is not None:
                _same_shape("labels", labels, slot.labels)
            with torch.no_grad():  # the static x is a leaf that requires grad
                slot.x.copy_(x)
                if labels is not None:
                    slot.labels.copy_(labels)
        slot.forward_graph.replay()
        return slot.out

    def backward(self, chunk: int, microbatch: int, grad: torch.Tensor | float,
                 deferred: bool = False) -> torch.Tensor | None:
        """The gradient w.r.t. the chunk's input (None on the first chunk): its backward graph replayed.
        grad: the gradient of the output, or the loss scale on the last chunk. deferred: ZB-H1's B pass,
        the linear layers' weight gradients left to `weight`."""
        slot = self.slots[(chunk, microbatch)]
        with torch.no_grad():
            if isinstance(grad, torch.Tensor):
                _same_shape("the output gradient", grad, slot.grad_out)
                slot.grad_out.copy_(grad)
            else:
                slot.grad_out.fill_(grad)
        if slot.backward_graph is None:  # first step: captured here (grad_out already holds this step's value)
            self._capture_backward(slot, chunk, microbatch, deferred)
        slot.backward_graph.replay()
        return slot.grad_in

    def weight(self, chunk: int, microbatch: int) -> int:
        """ZB-H1's W pass of (chunk, microbatch): the weight gradients its B pass left, a graph replayed;
        returns how many weight-gradient closures the graph holds."""
        slot = self.slots[(chunk, microbatch)]
        if slot.weight_graph is None:  # first step: the closures the B capture queued, captured
            def weight_grads() -> None:
                slot.weight_closures = self.store.run((chunk, microbatch))

            slot.weight_graph, _ = cuda_graph.capture(weight_grads, self.pool)
        slot.weight_graph.replay()
        return slot.weight_closures

    def left_over(self) -> list:
        """What a step left queued (nothing, once every W capture ran the closures its B capture queued)."""
        return self.store.pending()

    # ------------------------------------------------------------------ capture

    def _call(self, chunk: int, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The chunk as the eager executor calls it."""
        if labels is not None:
            return self.model.chunks[chunk](x, labels=labels, reduction="sum")
        return self.model.chunks[chunk](x)

    def _capture_forward(self, chunk: int, x: torch.Tensor, labels: torch.Tensor | None) -> _ChunkSlot:
        static_x = x.detach().clone()
        if static_x.is_floating_point():
            static_x.requires_grad_(True)  # its .grad is what the backward graph writes
        slot = _ChunkSlot(static_x, None if labels is None else labels.clone())

        def forward() -> torch.Tensor:
            slot.root = self._call(chunk, slot.x, slot.labels)
            return slot.root.detach()

        slot.forward_graph, slot.out = cuda_graph.capture(forward, self.pool)
        slot.grad_out = torch.zeros_like(slot.out)  # outside the pool: an input, written before each replay
        return slot

    def _deferral(self, chunk: int, key, deferred: bool):
        """ZB-H1's B: the chunk's linear layers queue their weight gradients on self.store under `key`."""
        if not deferred:
            return contextlib.nullcontext()
        return defer_weight_grads(self.store, key, self.model.chunks[chunk].parameters())

    def _capture_backward(self, slot: _ChunkSlot, chunk: int, microbatch: int, deferred: bool) -> None:
        def backward() -> torch.Tensor | None:
            if slot.x.requires_grad:
                slot.x.grad = None  # allocated by the capture, so written (not accumulated into) by each replay
            with self._deferral(chunk, (chunk, microbatch), deferred):
                torch.autograd.backward(slot.root, slot.grad_out)  # frees the saved activations W does not hold
            return slot.x.grad if slot.x.requires_grad else None

        slot.backward_graph, slot.grad_in = cuda_graph.capture(backward, self.pool)

    def _warm_up(self, spec, microbatch: dict[str, torch.Tensor]) -> None:
        """Every local chunk's forward and backward on stand-in inputs of the static shapes, on a side
        stream (lazy initialisation and the allocator's first blocks stay out of the captures)."""
        pp, stage, v = self.mesh.pp_size, self.mesh.pp_rank, spec.virtual_stages
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), no_host_reads(python_entry_points=False), torch.enable_grad():
                for c in range(v):
                    first, last = p2p.is_first_chunk(pp, stage, c), p2p.is_last_chunk(pp, v, stage, c)
                    x = microbatch["input_ids"] if first else torch.zeros(
                        spec.activation_shape, dtype=spec.dtype, device=self.mesh.device, requires_grad=True)
                    for _ in range(cuda_graph.WARMUP_ITERATIONS):
                        out = self._call(c, x, microbatch["labels"] if last else None)
                        with self._deferral(c, "warm-up", spec.schedule == Schedule.ZB_H1):
                            torch.autograd.backward(out, torch.ones_like(out))
                        self.store.run("warm-up")
        except HostReadError as error:
            raise UsageError(f"--cuda-graph cannot capture this step: a host sync inside it ({error}); "
                             f"drop --cuda-graph") from error
        torch.cuda.current_stream().wait_stream(side)
        self.model.zero_grad()  # the warm-ups' gradients are not this step's (the buffers keep their addresses)
