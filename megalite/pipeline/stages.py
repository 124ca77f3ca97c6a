"""Pipeline parallelism over a user's own stages: the same schedules, verifier and executor as GPTModel.

    stages = split_layers(my_sequential, pp * v)                # or build the pp*v stage modules yourself
    pipe = Pipeline(stages, mesh, loss_fn, num_microbatches=8, activation_shape=(s, mb, h),
                    schedule="1f1b")                           # "gpipe", "1f1b", "interleaved" (v >= 2), "zb-h1", "dualpipev" (v = 2)
    model = DataParallel(pipe.chunks, mesh, zero_stage=1,      # this rank's chunks own their grads;
                         dp_reduction="sum")                   # the loss is over global tokens: sum over dp
    loss_sum = pipe.step([(inputs, labels), ...], loss_scale=1 / global_tokens, grad_sync=model)

Model chunk i (of pp*v, in model order) runs on pipeline rank i % pp (Megatron's interleaved
assignment: local chunk c is model chunk c*pp + pp_rank; under "dualpipev" rank r runs model
chunks r and 2pp-1-r, partition.ChunkPlacement.V). The first chunk is called with the
microbatch's inputs, every other with the previous chunk's output, which must have
`activation_shape` and `dtype` (receive buffers are allocated from them, no shape handshake);
the last chunk's output goes to `loss_fn(output, labels)`, which returns the loss SUM over the
microbatch (the executor backpropagates loss_sum * loss_scale, so the caller normalises once).
The schedule is built and verified (every send has its receive, no stage deadlocks) when the
Pipeline is made, before any step.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from megalite.distributed import comm
from megalite.distributed.mesh import Mesh
from megalite.pipeline.executor import PipelineSpec, run_pipeline
from megalite.pipeline.instructions import COMPUTE_KINDS
from megalite.pipeline.partition import model_chunk_id
from megalite.pipeline.replay import replay_bubble
from megalite.pipeline.schedules import ScheduleName, check_schedule_args, chunk_placement, verified_schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last chunk's output, labels) -> loss sum


class Stage(nn.Module):
    """One model chunk in the executor's calling convention: stage(x) -> the chunk's output; on the
    last model chunk stage(x, labels=..., reduction="sum") -> loss_fn(module(x), labels)."""

    def __init__(self, module: nn.Module, loss_fn: LossFn | None = None):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "sum") -> torch.Tensor:
        out = self.module(x)
        if labels is None:
            return out
        if self.loss_fn is None or reduction != "sum":
            raise ValueError("only the last pipeline stage computes the loss, as a sum (reduction='sum')")
        return self.loss_fn(out, labels)


def split_layers(layers: nn.Module | Sequence[nn.Module], num_chunks: int,
                 counts: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut a stack of layers (an nn.Sequential, nn.ModuleList or list) into `num_chunks` contiguous
    nn.Sequential chunks, in model order. counts: layers per chunk (default: as even as possible,
    the earlier chunks taking one more)."""
    layers = list(layers.children()) if isinstance(layers, nn.Module) else list(layers)
    if counts is None:
        if len(layers) < num_chunks:
            raise ValueError(f"{len(layers)} layers cannot fill {num_chunks} pipeline chunks (pp x virtual "
                             f"stages); use fewer stages or split a layer")
        base, extra = divmod(len(layers), num_chunks)
        counts = [base + (i < extra) for i in range(num_chunks)]
    counts = list(counts)
    if len(counts) != num_chunks or sum(counts) != len(layers) or min(counts) < 1:
        raise ValueError(f"counts {counts} must give {num_chunks} chunks of at least one layer adding up to "
                         f"{len(layers)} layers")
    starts = [sum(counts[:i]) for i in range(num_chunks)]
    return [nn.Sequential(*layers[start:start + n]) for start, n in zip(starts, counts)]


class Pipeline:
    """This rank's chunks of a user-staged model and the verified schedule that runs them.

    stages: all pp*v model chunks in model order (this rank keeps its own; build them all with one
      seed and every layout holds the same weights as one process), or a callable
      `model_chunk_id -> module` that builds only the chunks asked for.
    loss_fn: (last chunk's output, labels) -> loss sum over the microbatch.
    activation_shape, dtype: what every chunk boundary carries, e.g. [s, mb, h].
    """

    def __init__(self, stages: Sequence[nn.Module] | Callable[[int], nn.Module], mesh: Mesh, loss_fn: LossFn, *,
                 num_microbatches: int, activation_shape: Sequence[int], schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B,
                 virtual_stages: int = 1, dtype: torch.dtype = torch.float32):
        pp, v = mesh.pp_size, virtual_stages
        check_schedule_args(schedule, pp, num_microbatches, v)
        verified_schedule(schedule, pp, num_microbatches, v)  # proven deadlock-free before any step
        if not callable(stages) and len(stages) != pp * v:
            raise ValueError(f"got {len(stages)} stage modules for pp={pp} x virtual_stages={v} = {pp * v} model "
                             f"chunks; pass one per chunk (split_layers(model, {pp * v}) cuts one module)")
        ids = [model_chunk_id(pp, mesh.pp_rank, c, chunk_placement(schedule)) for c in range(v)]
        last = pp * v - 1
        self.chunks = [Stage(stages(i) if callable(stages) else stages[i], loss_fn if i == last else None)
                       for i in ids]
        self.mesh = mesh
        self.spec = PipelineSpec(schedule, num_microbatches, tuple(activation_shape), dtype, v)
        self.last_step_seconds = 0.0

    def step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             loss_scale: float | torch.Tensor | Callable[[], Any] = 1.0, *, grad_sync=None,
             stats: dict[str, Any] | None = None, measure_bubble: bool = False) -> float:
        """Forward and backward of every (inputs, labels) microbatch under the schedule.

        grad_sync: the DataParallel wrapping `self.chunks` (its buckets reduce during each chunk's
        last backward; then finish_grad_sync() or the sharded optimizer's step completes them).
        stats, if given, gets the executor's counters ("transfer_wait_s", "compute_s", ...) and
        "step_s"; with measure_bubble (on every rank alike: one small all-gather over the pipeline
        group) also "bubble_fraction", the schedule replayed with every stage's measured times.
        Returns the sum of the unscaled loss sums on the last stage, 0.0 on the others."""
        start = time.perf_counter()
        batches = [{"input_ids": inputs, "labels": labels} for inputs, labels in microbatches]
        counters: dict[str, Any] = {}
        if grad_sync is not None:  # each chunk's buckets reduce during that chunk's last backward only
            grad_sync.set_last_microbatch(False)
        loss_sum = run_pipeline(self.spec, self.chunks, batches, self.mesh, loss_scale, grad_sync=grad_sync,
                                stats=counters)
        if grad_sync is not None:
            grad_sync.set_last_microbatch(True)
        self.last_step_seconds = time.perf_counter() - start
        if measure_bubble:
            counters["bubble_fraction"] = self.bubble_fraction(counters["compute_s"])
        if stats is not None:
            stats.update(counters, step_s=self.last_step_seconds)
        return loss_sum

    def bubble_fraction(self, compute_s: dict[str, float]) -> float:
        """The idle share of this pipeline (see `measured_bubble`). Collective over pp."""
        return measured_bubble(compute_s, self.mesh, self.spec)


def measured_bubble(compute_s: dict[str, float], mesh: Mesh, spec: PipelineSpec) -> float:
    """The idle share of the pipeline: every stage's median seconds per instruction kind (`run_pipeline`
    stats "compute_s"), all-gathered over the pipeline group, replayed through the schedule
    (replay.py). Collective over `mesh.pp_group`: every rank of it calls this together."""
    mine = torch.tensor([[compute_s.get(kind, 0.0) for kind in COMPUTE_KINDS]], dtype=torch.float64)
    every = comm.all_gather(mine.to(mesh.device), mesh.pp_group).cpu()  # [pp, kinds], by stage
    durations = [dict(zip(COMPUTE_KINDS, row.tolist())) for row in every]
    schedule = verified_schedule(spec.schedule, mesh.pp_size, spec.num_microbatches, spec.virtual_stages)
    return replay_bubble(schedule, mesh.pp_size, spec.virtual_stages, durations,
                         placement=chunk_placement(spec.schedule))
