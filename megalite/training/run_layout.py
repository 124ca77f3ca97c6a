"""The run layout the planner reasons about: degrees, batch, precision, schedule, recompute.

Pure data (no torch, no process group): `Layout` mirrors pretrain_gpt's flags, and
`stage_layers` says how many blocks each pipeline stage holds (from megalite.pipeline.partition).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.model.config import GPTConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE_CHOICES = ("none", "selective", "full")
SCHEDULE_CHOICES = ("1f1b", "interleaved", "gpipe", "zb-h1")  # megalite.pipeline.schedules
GB = 1e9


@dataclass
class Layout:
    """How one training run is laid out over the GPUs (the flags of pretrain_gpt)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    """Model chunks per pipeline stage (> 1: interleaved 1F1B)."""
    zero_stage: int = 0
    """0: replicated optimizer; 1: shard optimizer state; 2: + grads; 3: + params (over dp)."""
    offload_optimizer: bool = False
    """Optimizer state (and its step) lives in host memory."""
    recompute: str = "none"
    """none | selective (attention core) | full (whole blocks; only block inputs kept)."""
    recompute_num_layers: int | None = None
    """With full recompute: only the first N blocks of each model chunk (None: all)."""
    sequence_parallel: bool = False
    fused_linear_cross_entropy: bool = False
    """Output layer + cross entropy in token chunks: the logits shard is never kept."""
    micro_batch_size: int = 1
    seq_length: int | None = None
    """None: the model's seq_length."""
    global_batch_size: int | None = None
    """Sequences per optimizer step; None: micro_batch_size * dp * num_microbatches."""
    num_microbatches: int | None = None
    """Gradient-accumulation microbatches per step and DP rank; None: from global_batch_size."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16 (the dtype of params and activations; bf16/fp16 keep fp32 master weights)."""
    grad_reduce_dtype: str | None = None
    """dtype of the gradient buffer and its DP reduction; None: fp32 (megalite's main grads)."""
    first_stage_layers: int | None = None
    """Blocks of the first model chunk (--decoder-first-stage-layers); None: an even split."""
    last_stage_layers: int | None = None
    """Blocks of the last model chunk (--decoder-last-stage-layers); None: an even split."""
    pipeline_layout: str | None = None
    """Explicit blocks per model chunk, e.g. "3,5,5,3" (--pipeline-layout)."""
    schedule: str | None = None
    """Pipeline schedule (megalite.pipeline.schedules); None or 1f1b: 1f1b, interleaved when
    virtual_stages > 1."""
    device: str = "cuda"
    """Where the run's RNG generators live: recompute checkpoints keep their states (16 bytes
    each on CUDA, 5056 on CPU). Activations are counted for megalite's kernels (the Triton path,
    also run on CPU by MEGALITE_KERNEL_BACKEND=triton TRITON_INTERPRET=1); the plain-PyTorch
    references keep extra fp32 copies."""

    def schedule_name(self) -> str:
        if self.schedule in (None, "1f1b") and self.virtual_stages > 1:
            return "interleaved"  # Megatron's name for 1F1B with virtual stages
        return self.schedule or "1f1b"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def microbatches(self) -> int:
        if self.num_microbatches is not None:
            return self.num_microbatches
        if self.global_batch_size is None:
            return 1
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    def global_batch(self) -> int:
        return self.micro_batch_size * self.dp * self.microbatches()


def _chunk_counts(model: GPTConfig, layout: Layout) -> list[int]:
    from megalite.pipeline.partition import chunk_layer_counts

    return chunk_layer_counts(model.num_layers, layout.pp, layout.virtual_stages, layout.first_stage_layers,
                              layout.last_stage_layers, layout.pipeline_layout)


def stage_layers(model: GPTConfig, layout: Layout) -> list[int]:
    """Blocks held by each pipeline stage (all its chunks), from megalite.pipeline.partition:
    local chunk c of stage r is model chunk c*pp + r (Megatron's interleaved assignment)."""
    counts, pp = _chunk_counts(model, layout), layout.pp
    return [sum(counts[c] for c in range(len(counts)) if c % pp == r) for r in range(pp)]


def recomputed_stage_layers(model: GPTConfig, layout: Layout) -> list[int]:
    """Blocks of each stage that full recompute re-runs: all of them, or the first
    recompute_num_layers of each of its chunks; none without full recompute."""
    if layout.recompute != "full":
        return [0] * layout.pp
    counts, pp, n = _chunk_counts(model, layout), layout.pp, layout.recompute_num_layers
    per_chunk = [c if n is None else min(n, c) for c in counts]
    return [sum(per_chunk[c] for c in range(len(counts)) if c % pp == r) for r in range(pp)]


def recompute_fraction(model: GPTConfig, layout: Layout) -> float:
    """Share of all blocks whose forward full recompute runs twice (0 without it)."""
    return sum(recomputed_stage_layers(model, layout)) / model.num_layers
