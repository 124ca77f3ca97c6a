"""Triton kernels for megalite's hot paths, each beside its plain-PyTorch reference.

Installed as `megalite.kernels` (never as a top-level `kernels`). Every function below picks
its implementation per call from MEGALITE_KERNEL_BACKEND (see `dispatch`): `auto` runs the
Triton kernels on CUDA tensors and the references elsewhere; `triton` forces the kernels
(on CPU with TRITON_INTERPRET=1, Triton's interpreter); `torch` forces the references.
Importing this package does not need triton; the references always work.

Differentiable ops (forward and backward kernels):
    rms_norm(x, weight, eps=1e-6)                         -> y
    rms_norm_residual(x, residual, weight, eps=1e-6)      -> (rms_norm(x + residual), x + residual)
    layer_norm(x, weight, bias, eps=1e-5)                 -> y
    layer_norm_residual(x, residual, weight, bias, eps=1e-5) -> (layer_norm(x + residual), x + residual)
    gelu(x)                                               -> F.gelu(x, approximate="tanh")
    bias_gelu(x, bias)                                    -> gelu(x + bias)
    swiglu(gate, up)                                      -> silu(gate) * up
    rope(x, cos, sin)                                     -> x*cos + rotate_half(x)*sin, x [s, b, n, d]
    cross_entropy(logits, targets, ignore_index=-100)     -> per-token float32 losses
    vocab_parallel_cross_entropy(logits_shard, targets, vocab_start_index, tp_group,
                                 ignore_index=-100, vocab_size=None) -> per-token float32 losses
    attention(q, k, v, causal=True, softmax_scale=None, dropout_p=0.0, dropout_seed=0, dropout_offset=0,
              documents=None)                             -> q [b, h, s, d], k, v [b, h_kv, s, d]
        documents: a DocumentMask (packed documents, sliding window; attention_documents.py)
    bias_dropout_add(x, bias=None, residual=None, p=0.0, seed=0, offset=0) -> residual + dropout(x + bias)
    grouped_mm(x, weight, group_sizes)                    -> y [T, N]: x's rows of group g @ weight[g] [K, N]
    grouped_mm_grads(x, weight, group_sizes, dy)          -> (dx, dweight): its backward, for an own autograd node
    permute_tokens(x, expert_ids, num_experts)            -> (rows of x sorted by expert, sorted_index, group_sizes)
    unpermute_tokens(y, sorted_index, weights, num_tokens) -> [T, H]: each token's routing-weighted rows
Dropout masks are Philox words of (seed, offset + element index), regenerated in backward
(`philox.keep_mask`, `attention_torch.attention_keep_mask` give them in PyTorch).
One block of a longer softmax row (ring attention; Triton only, not differentiable):
    attention_forward_with_lse(q, k, v, causal, softmax_scale)      -> (out, lse fp32 [b, h, s])
    attention_backward_with_lse(q, k, v, out, dout, lse, causal, softmax_scale) -> (dq, dk, dv)
In-place optimizer step:
    adamw_step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step)
"""
from .adamw import adamw_step, adamw_step_reference
from .attention_block import attention_backward_with_lse, attention_forward_with_lse
from .attention_documents import DocumentMask
from .bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from .cross_entropy import cross_entropy, cross_entropy_reference, vocab_parallel_cross_entropy
from .dispatch import BACKENDS, HAVE_TRITON, backend_name
from .flash_attention import SUPPORTED_HEAD_DIMS, attention, attention_reference
from .gelu import bias_gelu, bias_gelu_reference, gelu, gelu_reference
from .grouped_gemm import grouped_mm, grouped_mm_grads, grouped_mm_reference
from .layer_norm import layer_norm, layer_norm_reference, layer_norm_residual, layer_norm_residual_reference
from .moe_permute import permute_tokens, permute_tokens_reference, unpermute_tokens, unpermute_tokens_reference
from .rms_norm import rms_norm, rms_norm_reference, rms_norm_residual, rms_norm_residual_reference
from .rope import rope, rope_reference
from .swiglu import swiglu, swiglu_reference

__all__ = [
    "BACKENDS", "DocumentMask", "HAVE_TRITON", "SUPPORTED_HEAD_DIMS", "adamw_step", "adamw_step_reference", "attention",
    "attention_backward_with_lse", "attention_forward_with_lse", "attention_reference", "backend_name",
    "bias_dropout_add", "bias_dropout_add_reference", "bias_gelu", "bias_gelu_reference", "cross_entropy",
    "cross_entropy_reference", "gelu", "gelu_reference", "grouped_mm", "grouped_mm_grads", "grouped_mm_reference", "layer_norm",
    "layer_norm_reference", "layer_norm_residual", "layer_norm_residual_reference", "permute_tokens",
    "permute_tokens_reference", "rms_norm", "rms_norm_reference", "rms_norm_residual", "rms_norm_residual_reference",
    "rope", "rope_reference", "swiglu", "swiglu_reference", "unpermute_tokens", "unpermute_tokens_reference",
    "vocab_parallel_cross_entropy",
]
