"""What one training step reports: `train_step`'s result, typed (one field per fact, read by name)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megalite.pipeline.executor import PipelineSpec


@dataclass(frozen=True)
class PipelineTiming:
    """What a pp > 1 step's pipeline ran on this stage, for the measured bubble
    (megalite.pipeline.stages.measured_bubble)."""

    spec: PipelineSpec  # the schedule, microbatches and chunks every stage ran
    compute_s: dict[str, float]  # this stage's median seconds per compute instruction kind ("F", "B", ...)


@dataclass
class StepResult:
    """One step's numbers, the same on every rank unless a field says otherwise.

    exposed_*_s: host seconds blocked on dp communication, in total and by cause (the token count's
    wait is, with --overlap-param-gather, a wait for the gathers queued before it on the dp group).
    """

    loss: float  # the global mean loss over every target token of the step (all dp and cp ranks)
    grad_norm: float  # the global norm of the true (unscaled, unclipped) gradients
    skipped: bool  # no update: a non-finite loss or gradient somewhere
    loss_scale: float  # the fp16 loss scale this step ran with (1.0 without one)
    tokens: int  # target tokens of the step over all dp ranks
    loss_finite: bool
    lr: float  # the learning rate of this step's update (the optimizer's first group)
    exposed_dp_comm_s: float
    exposed_grad_reduce_s: float
    exposed_param_gather_s: float
    exposed_token_count_s: float
    # MoE layers' statistics (`moe.bookkeeping.moe_stats`: 'moe_aux_loss', 'moe_layers', ...); {} without experts
    moe: dict[str, Any] = field(default_factory=dict)
    # DeepSeek's multi-token prediction: {'mtp_loss_1': depth 1's mean loss, ...}; {} without it
    mtp: dict[str, float] = field(default_factory=dict)
    # pp > 1: the schedule this stage ran and its instructions' seconds, for the measured bubble
    pipeline: PipelineTiming | None = None
    # --grad-compression: bytes sent on the dp group (and edp), and uncompressed bytes / sent
    grad_reduce_bytes: int | None = None
    grad_compression_ratio: float | None = None
    # packed documents or a sliding window: the keys per query this rank's microbatches attend to, in
    # the FLOP count's convention (config.model.attention_span; the meter's MFU); None: the sequence length
    attention_span: float | None = None
