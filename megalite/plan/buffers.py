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
  Or its forward's combine (moe/dispatcher.py), whichever is larger: with the all-to-all at ep > 1 the
  experts' output rows [R, h] (R = T' k routes, T' the tokens routed here) and their source-major copy,
  both still referenced while the rows sent back are unpermuted into [T', h]: a*(2 R h + T' h); at
  DeepSeek-V3's layout (ep 64, k 8, T' 4,096) 998 MB, where the GEMM's is 470 MB.

- FP8 (--fp8-format): tensorwise keeps the MLP-out linear's input only as FP8, but the input lives
  beside the output until the MLP returns; and its forward GEMM holds the FP8 operands beside the
  output (plan/fp8.forward_buffer_bytes); the grouped experts' weight cast for the input gradient,
  in torch: stacked weights, an fp32 copy and two FP8 copies (plan/fp8.expert_weight_cast_bytes).

- the last stage's head in backward (not with --fused-linear-cross-entropy), at the larger of two moments:
  the cross entropy's backward writes the logits' gradient [T, V/tp] beside the logits it kept (counted
  in the activations): a*T*V/tp; then the output layer's backward, the logits freed (the gradient takes
  their place), makes its weight gradient [V/tp, h] in the training dtype, before it is added into the
  fp32 main gradient, beside the gradient of its input, [T, h] (under sequence parallelism the input
  re-gathered, [T, h], and the input gradient's reduce-scattered shard, [T/tp, h]): a*(V/tp)*h +
  a*T*h*(1 + r'), r' = 1/tp with SP, else 0. At llama-405b's last stage (tp 8, vocabulary 128,256 padded
  to 129,024, s 8192) the second, 528.5 + 268.4 MB, is above a block's 536.9 MB: --simulate found it
  (docs/simulate.md, "Differences it names"); with a small hidden size the first is the larger.
  Under full recompute the block being re-run (counted in the activations on the head's stage) is not
  live while the output layer runs its backward, so this term counts only what exceeds it
  (activations.recompute_beside_heads): DeepSeek-V3's last stage peaks recomputing its MoE block.

The larger of these is the stage's buffer term: the blocks and the head run one at a time. Beside it,
always live and no parameter: Llama's RoPE tables, fp32 cos and sin [seq_length, d_rope] in each model
chunk a rank holds (`model_buffer_bytes`; 8.4 MB at llama-405b).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.choices import MoEDispatcher
from megalite.config.model import GPTConfig
from megalite.plan import fp8
from megalite.plan.activations import recompute_beside_heads
from megalite.plan.layout import DTYPE_BYTES, head_stage, local_seq_length
from megalite.plan.moe import routed_tokens, stage_moe_layers

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


def combine_buffer_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """An MoE block's combine: the unpermute's output [T', h] and, with the all-to-all at ep > 1, the experts'
    output rows and their source-major copy [R, h] each (module docstring)."""
    a, h = DTYPE_BYTES[cfg.precision.precision], model.hidden_size
    mine = routed_tokens(model, cfg)
    exchanged = cfg.parallel.ep > 1 and cfg.parallel.moe_token_dispatcher_type == MoEDispatcher.ALLTOALL
    return a * h * (mine + (2 * mine * model.moe.topk if exchanged else 0))


def head_backward_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """The last stage's head in backward: the logits' gradient beside the logits, or the output layer's
    weight gradient and its input's (module docstring)."""
    p = cfg.parallel
    if p.fused_linear_cross_entropy:  # the fused kernel's chunks: not this shape (not measured here)
        return 0
    a, vocab_shard = DTYPE_BYTES[cfg.precision.precision], model.padded_vocab_size(p.tp) // p.tp
    tokens = local_seq_length(model, cfg) * cfg.training.micro_batch_size
    logits_grad = a * tokens * vocab_shard  # [T, V/tp]
    weight_grad = a * vocab_shard * model.hidden_size  # [V/tp, h]
    if p.sequence_parallel and p.tp > 1:  # the re-gathered input [T, h] and the gradient's shard [T/tp, h]
        return max(logits_grad, weight_grad + a * tokens * model.hidden_size * (p.tp + 1) // p.tp)
    return max(logits_grad, weight_grad + a * tokens * model.hidden_size)  # the input's gradient [T, h]


def model_buffer_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """The model's non-parameter buffers on a rank: each chunk's RoPE cos and sin tables (llama flavour)."""
    if model.flavour != "llama":
        return 0
    return 2 * 4 * model.seq_length * model.rope_head_dim * cfg.parallel.virtual_stages


def buffer_bytes(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None = None) -> int:
    """Bytes live at the peak of a rank of pipeline stage `stage` beside the model states and the saved
    activations: the larger transient working set and the model's buffers (module docstring)."""
    return _transient_bytes(model, cfg, stage, attention) + model_buffer_bytes(model, cfg)


def _transient_bytes(model: GPTConfig, cfg: RunConfig, stage: int, attention: str | None) -> int:
    dense = block_output_bytes(model, cfg)
    dense = max(dense, fp8.forward_buffer_bytes(model, cfg, dense))  # FP8: the MLP-out linear's working set
    if stage == head_stage(cfg):  # the output layer's backward, when no recomputed block is live beside it
        dense = max(dense, head_backward_bytes(model, cfg) - recompute_beside_heads(model, cfg, stage, attention))
    if model.moe is None or not stage_moe_layers(model, cfg, stage):
        return dense
    return max(dense, expert_gemm_buffer_bytes(model, cfg), combine_buffer_bytes(model, cfg),
               fp8.expert_weight_cast_bytes(model, cfg))
