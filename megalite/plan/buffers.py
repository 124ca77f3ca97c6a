"""Transient buffers at a rank's peak: bytes live beside the model states and the saved activations.

Pure arithmetic (no torch). `--simulate` counts every storage at the rank's peak
(docs/simulate.md); beside parameters, gradients, optimizer state and what autograd keeps for
backward, one block's working tensors are live there. Per rank of a stage, a = bytes of the
training dtype, T = s/cp * b tokens of a microbatch, h the hidden size:

- a dense block: the MLP's output [T, h] and, under tp, its reduction's output (all-reduce:
  [T, h] again; reduce-scatter under sequence parallelism: [T/tp, h]): a*T*h*(1 + r),
  r = 0 at tp 1, 1/tp with SP, 1 otherwise. (The peak is reached at the end of the last
  warm-up forward, with every microbatch in flight saved.)
- an MoE block: the grouped GEMM's backward (moe/expert_gemm.py) stacks the local experts'
  weights [E/ep, K, N] as a temporary and writes their weight gradient [E/ep, K, N] before
  handing each expert its slice: 2*a*(E/ep)*h*max(mlp_in, f_e)/etp for the widest GEMM (fc1:
  h x mlp_in, mlp_in = 2 f_e for SwiGLU). At Mixtral 8x7B, ep 1, etp 1, that is 3.76 GB.

- FP8 (--fp8-format): tensorwise keeps the MLP-out linear's input only as FP8, but the input lives
  beside the output until the MLP returns; and its forward GEMM holds the FP8 operands beside the
  output (plan/fp8.forward_buffer_bytes); the grouped experts' weight cast for the input gradient,
  in torch: stacked weights, an fp32 copy and two FP8 copies (plan/fp8.expert_weight_cast_bytes).

The larger of these is the stage's buffer term: the blocks run one at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan import fp8
from megalite.plan.layout import DTYPE_BYTES, local_seq_length
from megalite.plan.moe import stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def block_output_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """A dense block's MLP output and its tp reduction's output (see the module docstring)."""
    p = cfg.parallel
    tokens_h = local_seq_length(model, cfg) * cfg.training.micro_batch_size * model.hidden_size
    a = DTYPE_BYTES[cfg.precision.precision]
    if p.tp == 1:
        return a * tokens_h
    return a * tokens_h + a * tokens_h // (p.tp if p.sequence_parallel else 1)


def expert_gemm_buffer_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """The widest expert grouped GEMM's backward: stacked weights and stacked weight gradient."""
    moe, h = model.moe, model.hidden_size
    ffn = moe.expert_ffn(model.ffn_hidden_size)
    mlp_in = ffn if model.flavour == "gpt2" else 2 * ffn
    widest = moe.num_experts // cfg.parallel.ep * h * max(mlp_in, ffn) // cfg.etp_size
    return 2 * DTYPE_BYTES[cfg.precision.precision] * widest


def buffer_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Transient bytes live at the peak of a rank of pipeline stage `stage` (module docstring)."""
    dense = block_output_bytes(model, cfg)
    dense = max(dense, fp8.forward_buffer_bytes(model, cfg, dense))  # FP8: the MLP-out linear's working set
    if model.moe is None or not stage_moe_layers(model, cfg, stage):
        return dense
    return max(dense, expert_gemm_buffer_bytes(model, cfg), fp8.expert_weight_cast_bytes(model, cfg))
