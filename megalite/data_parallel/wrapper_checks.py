"""What `DataParallel` (wrapper.py) refuses, before it allocates a buffer or joins a collective.

Every refusal is the same on every rank (it reads only the arguments and the modules), so a wrong
combination ends on all ranks alike instead of one rank waiting in a collective the others never join.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from megalite import errors
from megalite.data_parallel.powersgd import PowerSGDConfig
from megalite.distributed.mesh import Mesh
from megalite.tensor_parallel.sequence_parallel import unmarked_norm_problem


def check_arguments(chunks: Sequence[nn.Module], mesh: Mesh, *, zero_stage: int, dp_reduction: str,
                    grad_compression: PowerSGDConfig | None, overlap_param_gather: bool,
                    fp8_param_gather: bool) -> None:
    """ValueError for an argument the wrapper cannot honour; UsageError for a norm among sequence-parallel
    layers that does not say whether it sees a sequence shard."""
    if fp8_param_gather and zero_stage != 3:
        raise ValueError(f"fp8_param_gather is ZeRO-3's parameter all-gather in FP8; zero_stage is {zero_stage}")
    if dp_reduction not in ("mean", "sum"):
        raise ValueError(f"dp_reduction must be 'mean' (the model returns a per-rank mean loss, as with torch "
                         f"DDP) or 'sum' (the loss is divided by the global token count), got {dp_reduction!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if grad_compression is not None and zero_stage not in (0, 1, 2):
        raise ValueError(f"gradient compression composes with zero_stage 0, 1 or 2, not {zero_stage}: ZeRO-3 "
                         f"never holds a whole accumulated gradient to factor; use zero_stage=2")
    if overlap_param_gather and zero_stage in (0, 3):
        raise ValueError("overlap_param_gather needs zero_stage 1 or 2 (at zero 0 nothing is gathered; ZeRO-3 "
                         "gathers each unit right before its forward, never after the step)")
    # A norm among sequence-parallel layers must declare whether it sees a sequence shard, or its
    # gradient is silently 1/tp partial (tensor_parallel/norms.py, sequence_parallel.py).
    problem = unmarked_norm_problem(chunks, mesh.tp_size)
    if problem is not None:
        raise errors.UsageError(f"DataParallel: {problem}")
