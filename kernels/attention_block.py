"""One block of a longer attention softmax row (ring attention), on the flash-attention kernels.

Ring attention (megalite.context_parallel) computes one row's softmax over key blocks held by
different ranks: `attention_forward_with_lse` returns a block's output with its natural-log
lse (blocks merge by log-sum-exp), and `attention_backward_with_lse` differentiates one block
given the row's final output and lse (the same three backward kernels as flash_attention.py,
handed them). Triton only; not differentiable themselves (ring.py's autograd.Function calls
them). No dropout: a block's probabilities are not the row's until every block is merged.
A causal block may carry packed documents / a window (`documents`, in the block's own rows: ring
attention's own chunks, context_parallel/block_attention.py's `BlockMask.local`).
"""
from __future__ import annotations

import torch

from .attention_documents import DocumentMask
from .flash_attention import (LOG2E, _check_documents, _check_kernel_inputs, _check_shapes, _launch_backward,
                              _launch_forward, _pad_head_dim, _unit_stride)


def attention_forward_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                               softmax_scale: float,
                               documents: DocumentMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward of one block: (out [b, h, sq, d] in q.dtype, lse fp32 [b, h, sq]).

    lse[i] = log(sum_j exp(softmax_scale * q_i . k_j)) over this block's keys j (natural log),
    so blocks of one row merge exactly by log-sum-exp. Causal needs sq == sk (the diagonal).
    documents: a causal block's packed documents / window in its own rows (the varlen kernels).
    """
    _check_shapes(q, k, v)
    _check_kernel_inputs(q, k, v, causal)
    if documents is not None:
        _check_documents(q, k, causal, documents)
    head_dim = q.shape[-1]
    q, k, v = _pad_head_dim(head_dim, *_unit_stride(q, k, v))
    out, lse2 = _launch_forward(q, k, v, bool(causal), float(softmax_scale), documents=documents)
    return out[..., :head_dim], lse2 * (1.0 / LOG2E)  # log2 -> natural log


def attention_backward_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                dout: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float,
                                documents: DocumentMask | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward of one block: (dq, dk, dv) in the inputs' dtypes.

    out [b, h, sq, d], dout and lse fp32 [b, h, sq] belong to the whole softmax row the block is
    part of (every key block merged): p = exp(scale q k^T - lse) is then this block's slice of
    the row's probabilities and delta = rowsum(dout * out) the row's, which makes the
    gradients exact whatever the other blocks are.
    """
    _check_shapes(q, k, v)
    _check_kernel_inputs(q, k, v, causal)
    if documents is not None:
        _check_documents(q, k, causal, documents)
    head_dim = q.shape[-1]
    q, k, v = _pad_head_dim(head_dim, *_unit_stride(q, k, v))
    out, dout = (t.contiguous() for t in _pad_head_dim(head_dim, out.to(q.dtype), dout.to(q.dtype)))
    lse2 = (lse.float() * LOG2E).contiguous()
    dq, dk, dv = _launch_backward(q, k, v, out, dout, lse2, bool(causal), float(softmax_scale), documents=documents)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]
