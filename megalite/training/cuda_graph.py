"""--cuda-graph: each microbatch's forward and backward captured once as a CUDA graph, then replayed.

A small model's step is bound by the host: Python, the dispatcher and ~1000 kernel launches
per microbatch cost more than the kernels (GPT-2 small on an H200: 46-55 ms wall for 17 ms of
GPU work). A CUDA graph records those launches once; a replay issues all of them with one call.

What is captured, per microbatch slot (`StepGraphs`, pp = 1):

    static_ids, static_labels [b, s] (int64)  --copy_ in-->  forward -> loss sum (fp32 scalar)
    static_scale (fp32 scalar)                --copy_ in-->  (loss * scale).backward()
                                                             -> += into the DP wrapper's fp32
                                                                main-grad buffers (fixed addresses)

- Static inputs: each replay copies the microbatch into the same buffers; a microbatch of another
  shape cannot replay (dynamic shapes are refused with the shape that changed).
- Warm-up on a side stream (as torch.cuda.graph requires: lazy initialisation, cuBLAS workspaces
  and the allocator's first blocks must not happen inside the capture), run under
  `host_reads.no_host_reads()`: a value read inside forward or backward would end the capture
  with an opaque CUDA error, so it is refused first with the read named. The warm-ups' gradients
  are discarded (`zero_grad`, after every slot is captured and before the first replay).
- One memory pool shared by every slot's graph (`torch.cuda.graph_pool_handle`): the slots run
  one after another, so their activations can reuse the same blocks.
- Outside the graph, every step: the optimizer (grad norm, clipping, the update and the
  parameter all-gathers read the norm on the host once), the DP reduction (GradBuffers launches
  every bucket in `finish_reduction`; the Python bucket bookkeeping of backward hooks would run
  at capture only, so the graphed backward accumulates with synchronisation off), the token
  count's all-reduce and the float() of the loss sum after the last microbatch.

Refused (config.checks.cuda_graph_problems): tp, cp or ep > 1 (their collectives run inside
forward and backward and the byte ledger counts on the host per call), ZeRO 2 and 3 (gradient
or parameter storage allocated and freed inside the step), dropout (its Philox seeds are Python
integers drawn per call: a replay would repeat the captured masks), recompute, offload, MoE
layers (routing statistics recorded in Python per forward), and a machine without CUDA (exit 2).
At pp > 1 a microbatch's forward and backward are separate graphs per pipeline chunk, with the
transfers between them: training/pipeline_graphs.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from megalite.distributed.host_reads import HostReadError, no_host_reads
from megalite.errors import UsageError

WARMUP_ITERATIONS = 3  # torch's make_graphed_callables warms up 3 times too: autotuning, allocator, lazy init


class _Slot:
    """One microbatch position's graph: static inputs, the captured forward+backward, its loss."""

    def __init__(self, graph: torch.cuda.CUDAGraph, ids: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
                 loss: torch.Tensor):
        self.graph, self.ids, self.labels, self.scale, self.loss = graph, ids, labels, scale, loss

    def replay(self, microbatch: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        for name, static in (("input_ids", self.ids), ("labels", self.labels)):
            if microbatch[name].shape != static.shape:
                raise ValueError(f"--cuda-graph: {name} has shape {tuple(microbatch[name].shape)} but the graph was "
                                 f"captured for {tuple(static.shape)}; shapes must be static (drop --cuda-graph)")
        self.ids.copy_(microbatch["input_ids"], non_blocking=True)
        self.labels.copy_(microbatch["labels"], non_blocking=True)
        self.scale.copy_(scale)
        self.graph.replay()
        return self.loss


class StepGraphs:
    """The captured microbatches of one model replica at pp = 1 (see the module docstring).

    model: the DataParallel wrapper (one chunk); slots are captured lazily, at a step's first use
    of each microbatch position, so the first step also runs the warm-up."""

    def __init__(self, model):
        if not torch.cuda.is_available():
            raise UsageError("--cuda-graph needs a CUDA GPU and none is visible here; drop --cuda-graph")
        if len(model.chunks) != 1:
            raise UsageError("StepGraphs captures one model chunk per microbatch (pp = 1); at pp > 1 use "
                             "pipeline_graphs.PipelineGraphs")
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.slots: list[_Slot] = []

    def check_shapes(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """UsageError when a microbatch cannot replay its captured slot: called before the step
        communicates anything (its token count), not inside the replays after it."""
        for i, (slot, mb) in enumerate(zip(self.slots, microbatches)):
            for name, static in (("input_ids", slot.ids), ("labels", slot.labels)):
                if mb[name].shape != static.shape:
                    raise UsageError(f"--cuda-graph: microbatch {i}'s {name} has shape {tuple(mb[name].shape)} but "
                                     f"its graph was captured for {tuple(static.shape)}; keep shapes static (e.g. "
                                     f"no partial last batch) or drop --cuda-graph")

    def run(self, microbatches: list[dict[str, torch.Tensor]], loss_scale: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every microbatch (replayed graphs); the loss sum, float64 on the device."""
        model = self.model
        scale = loss_scale()
        loss_sum = torch.zeros((), dtype=torch.float64, device=microbatches[0]["input_ids"].device)
        model.set_last_microbatch(False)  # no bucket bookkeeping inside captured backwards (see above)
        if len(self.slots) < len(microbatches):  # first step (or more microbatches): capture, all before any replay
            for mb in microbatches[len(self.slots):]:
                self.slots.append(self._capture(mb, scale))
            model.zero_grad()  # the warm-ups' gradients are not this step's (the buffers keep their addresses)
        for slot, mb in zip(self.slots, microbatches):
            loss_sum += slot.replay(mb, scale).double()
        model.set_last_microbatch(True)  # finish_reduction then launches every bucket
        return loss_sum

    def _forward_backward(self, ids, labels, scale) -> torch.Tensor:
        loss = self.model(ids, labels, reduction="sum")
        (loss * scale).backward()
        return loss.detach()

    def _capture(self, microbatch: dict[str, torch.Tensor], scale: torch.Tensor) -> _Slot:
        ids, labels = microbatch["input_ids"].clone(), microbatch["labels"].clone()  # the static inputs
        static_scale = scale.detach().clone().reshape(())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side), no_host_reads(python_entry_points=False):
                for _ in range(WARMUP_ITERATIONS):
                    self._forward_backward(ids, labels, static_scale)
        except HostReadError as error:
            raise UsageError(f"--cuda-graph cannot capture this step: a host sync inside it ({error}); "
                             f"drop --cuda-graph") from error
        torch.cuda.current_stream().wait_stream(side)
        graph, loss = capture(lambda: self._forward_backward(ids, labels, static_scale), self.pool)
        return _Slot(graph, ids, labels, static_scale, loss)


def capture(fn: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn's kernels recorded (not run) into a new graph drawing on `pool`; (graph, fn's static output).

    Each replay re-issues the same kernels on the same addresses: the output tensor holds the
    replay's result. (The CPU tests stand in a graph that re-runs fn, to check everything around it.)"""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
