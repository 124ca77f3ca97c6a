"""The operations under every layer: elementwise, attention and mixture-of-experts math, in one place.

Each function is `megalite.kernels`' op (Triton on CUDA tensors, the PyTorch reference elsewhere,
per MEGALITE_KERNEL_BACKEND), with the layout the layers use. This module sits below
tensor_parallel/, context_parallel/, moe/ and model/: it imports nothing else from megalite but the
choices' enums (config/choices.py, pure Python).
"""
from __future__ import annotations

import torch

from megalite import kernels
from megalite.config.choices import CPCommType, Precision
from megalite.kernels import attention_dispatch, attention_documents, attention_tiles


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., h]; weight, bias [h]."""
    return kernels.layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32, rounded once to x.dtype."""
    return kernels.rms_norm(x, weight, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU, tanh approximation (GPT-2's gelu_new)."""
    return kernels.gelu(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise."""
    return kernels.swiglu(gate, up)


class _SplitHeads(torch.autograd.Function):
    """qkv [s, b, sum(heads) * d] -> one view [s, b, heads_i, d] per block of heads (q, k, v).

    The backward concatenates the blocks' gradients along the head dim in one copy kernel. The
    autograd of `split` + `view` would first copy each gradient that is not contiguous (the
    attention kernel's [b, h, s, d] gradient, permuted back to [s, b, h, d]) to undo its view,
    then concatenate: four copies per block where one does (issue 26). The same values either way.
    """

    @staticmethod
    def forward(ctx, qkv, heads: tuple[int, ...], head_dim: int):
        s, b, _ = qkv.shape
        blocks = qkv.split([n * head_dim for n in heads], dim=-1)
        return tuple(block.view(s, b, n, head_dim) for block, n in zip(blocks, heads))

    @staticmethod
    def backward(ctx, *grads):  # each [s, b, heads_i, d], any strides (unused outputs: zeros)
        s, b = grads[0].shape[:2]
        return torch.cat(grads, dim=2).view(s, b, -1), None, None


def split_heads(qkv: torch.Tensor, heads: tuple[int, ...], head_dim: int) -> tuple[torch.Tensor, ...]:
    """qkv [s, b, sum(heads) * d] -> views [s, b, heads_i, d], one per block; see _SplitHeads."""
    return _SplitHeads.apply(qkv, tuple(heads), head_dim)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [s, b, heads, d]; cos, sin: [s, d], or [s, b, d] (each sample's positions)."""
    return kernels.rope(x, cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, dropout_seed: int = 0,
              dropout_offset: int = 0, documents: kernels.DocumentMask | None = None) -> torch.Tensor:
    """Causal attention. q: [b, h, s, d]; k, v: [b, h_kv, s, d] (grouped-query); out [b, h, s, d].

    documents: each query sees only its own packed document (and window), built once per microbatch
    (kernels/attention_documents.py); None: the whole causal sequence.

    With dropout the probabilities are dropped with the Philox mask of (dropout_seed,
    dropout_offset) (kernels/attention_torch.py: counters over [h, b, s, s], head-major), inside
    the flash kernel on CUDA and in the PyTorch path elsewhere; neither keeps anything per score.
    """
    return kernels.attention(q, k, v, causal=True, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset, documents=documents)


def latent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                     documents: kernels.DocumentMask | None = None) -> torch.Tensor:
    """Causal attention whose values are narrower than its queries and keys (multi-head latent attention):
    q, k [b, h, s, d_qk], v [b, h, s, d_v] -> [b, h, s, d_v]. megalite's Triton kernel takes one head dim
    of at most 128 for q, k and v, so this is torch's SDPA on every device (docs/deepseek.md). On the meta
    device (--simulate) the kernel CUDA's SDPA chooses for d_qk != d_v, by name: the memory-efficient one.
    documents: packed documents and/or a window: one SDPA call per document (the documents' lengths
    read to the host once per microbatch, kernels/attention_documents.py)."""
    if documents is not None:
        return attention_documents.attention_documents_reference(q, k, v, documents, softmax_scale)
    if q.is_meta:
        return attention_dispatch.memory_efficient_sdpa(q, k, v, True, softmax_scale)
    return attention_dispatch.sdpa(q, k, v, True, softmax_scale, native_gqa=False)


def describe_latent_attention(qk_head_dim: int, v_head_dim: int) -> str:
    """The start banner's line for a model with multi-head latent attention (`latent_attention`)."""
    return (f"attention: torch SDPA (multi-latent attention, d_qk {qk_head_dim} / d_v {v_head_dim}: megalite's "
            f"Triton kernel takes one head dim <= 128 for q, k and v)")


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per-expert matmul. x [T, K] rows sorted by expert, weight [E, K, N], group_sizes int64 [E]
    (on x's device, zeros allowed, sum == T) -> [T, N]; expert g's rows times weight[g]."""
    return kernels.grouped_mm(x, weight, group_sizes)


def permute_tokens(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, routed: int | None = None):
    """x [T, H], expert_ids int64 [T, k] (-1: not routed here) -> (permuted [R, H] sorted by expert,
    stable; sorted_index int64 [R], the flat token*k + slot of each row; group_sizes int64 [E]).
    routed: R when the caller knows it (no host read); None: counted from expert_ids."""
    return kernels.permute_tokens(x, expert_ids, num_experts, routed)


def unpermute_tokens(y: torch.Tensor, sorted_index: torch.Tensor, weights: torch.Tensor,
                     num_tokens: int) -> torch.Tensor:
    """y [R, H] as permute_tokens ordered it, weights [T, k] -> [T, H]: out[t] = sum over t's routed
    slots of weights[t, slot] * y[row of (t, slot)]."""
    return kernels.unpermute_tokens(y, sorted_index, weights, num_tokens)


def attention_implementation(head_dim: int, num_heads: int, num_query_groups: int, seq_length: int, dtype: str,
                             dropout_p: float, cp: int, cp_comm_type: str, device: torch.device) -> str:
    """Which implementation this model's attention calls run on `device`: "triton", "sdpa",
    "sdpa_gqa" or "reference" (kernels/attention_dispatch.py's names); the planner's activation
    bytes depend on it (megalite/plan/activations.py). Arguments as `describe_attention`'s."""
    backend = kernels.backend_name()
    if device.type != "cuda":
        return "triton" if backend == "triton" else "reference"
    if cp > 1 and cp_comm_type == CPCommType.P2P:
        return "triton"
    torch_dtype = Precision(dtype).torch_dtype
    arch = attention_tiles.cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return attention_dispatch.implementation(arch, head_dim, torch_dtype, seq_length, True, dropout_p,
                                             num_query_groups != num_heads, backend)


def describe_attention(head_dim: int, num_heads: int, num_query_groups: int, seq_length: int, dtype: str,
                       dropout_p: float, cp: int, cp_comm_type: str, device: torch.device) -> str:
    """The start banner's line: which attention implementation this model's calls run, and why.

    dtype: "fp32" | "bf16" | "fp16". With cp > 1 ring attention ("p2p") runs the Triton kernels'
    log-sum-exp entry points; Ulysses ("a2a") calls `attention` on the whole sequence.
    """
    backend = kernels.backend_name()
    if device.type != "cuda":
        if backend == "triton":
            return "attention: megalite Triton kernels in Triton's CPU interpreter (MEGALITE_KERNEL_BACKEND=triton)"
        return "attention: PyTorch reference (no GPU)"
    if cp > 1 and cp_comm_type == CPCommType.P2P:
        return f"attention: megalite Triton kernels (ring attention over cp={cp} merges their log-sum-exp)"
    torch_dtype = Precision(dtype).torch_dtype
    arch = attention_tiles.cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return attention_dispatch.describe(arch, head_dim, torch_dtype, seq_length, True, dropout_p,
                                       num_query_groups != num_heads, backend)
