"""Attention with Philox dropout in plain PyTorch: the definition, and the path CPU runs take.

The mask is the flash kernels' (kernels/flash_attention.py): score (row, col) of local head h
and batch element i keeps iff

    philox(seed, offset + ((h * b + i) * s + row) * s + col) >= drop_threshold(p)

i.e. counters run over the probabilities in [heads, b, s, s] order, head-major, so a tensor-
parallel rank holding heads [r*h/tp, (r+1)*h/tp) passes offset = r*(h/tp)*b*s*s and draws
exactly its heads' part of the tp=1 mask. Dropout applies to the probabilities after the
softmax (inverted: kept ones scaled by 1 / (1 - p)), as in Megatron and FlashAttention.

`attention_dropout_reference` is the definition in differentiable PyTorch: it materialises the
fp32 softmax and the mask for backward. `attention_dropout_torch` computes the same function
the way the kernels do and keeps what they keep: q, k, v, the output and one fp32 log-sum-exp
per row, no byte per score (the plain eager path kept ~8: fp32 softmax, mask, dropped
probabilities). Backward recomputes probabilities and mask one (batch, head) [s, s] block at a
time, which also bounds the transient memory of both passes to one block.
"""
from __future__ import annotations

import torch

from .philox import drop_threshold, philox_word


def attention_keep_mask(seed: int, offset: int, batch: int, heads: int, seq: int, p: float,
                        device=None, batch_index: int | None = None, head_index: int | None = None) -> torch.Tensor:
    """Keep-mask [b, h, s, s] (or one [s, s] block with batch_index and head_index) of the counters above."""
    if batch_index is not None:
        first = offset + (head_index * batch + batch_index) * seq * seq
        index = torch.arange(first, first + seq * seq, dtype=torch.int64, device=device).view(seq, seq)
    else:
        block = (torch.arange(heads, device=device)[None, :] * batch + torch.arange(batch, device=device)[:, None])
        index = offset + block.view(batch, heads, 1, 1) * seq * seq \
            + torch.arange(seq * seq, dtype=torch.int64, device=device).view(1, 1, seq, seq)
    return philox_word(seed, index) >= drop_threshold(p)


def _scores(q, k, softmax_scale: float, causal: bool) -> torch.Tensor:
    """fp32 scaled scores [..., s, s] with the causal mask applied as -inf."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * softmax_scale
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    return scores


def attention_dropout_reference(q, k, v, causal: bool, softmax_scale: float, p: float, seed: int,
                                offset: int) -> torch.Tensor:
    """softmax(q k^T * scale [causal]) with Philox dropout, times v; grouped-query heads repeated."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = torch.softmax(_scores(q, k, softmax_scale, causal), dim=-1)  # [b, h, s, s] fp32
    keep = attention_keep_mask(seed, offset, q.shape[0], q.shape[1], q.shape[2], p, q.device)
    dropped = torch.where(keep, probs * (1.0 / (1.0 - p)), 0.0)
    return torch.matmul(dropped, v.float()).to(q.dtype)


class _AttentionDropoutFunction(torch.autograd.Function):
    """Flash-style in PyTorch: one (batch, head) block of scores at a time; keeps q, k, v, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, p, seed, offset):
        b, h, s, _ = q.shape
        group, scale = h // k.shape[1], 1.0 / (1.0 - p)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        for i in range(b):
            for head in range(h):
                scores = _scores(q[i, head], k[i, head // group], softmax_scale, causal)  # [s, s]
                lse[i, head] = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - lse[i, head, :, None])
                keep = attention_keep_mask(seed, offset, b, h, s, p, q.device, i, head)
                out[i, head] = torch.matmul(torch.where(keep, probs * scale, 0.0), v[i, head // group].float())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.p, ctx.seed, ctx.offset = causal, softmax_scale, p, seed, offset
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, _ = q.shape
        group, scale, p = h // k.shape[1], 1.0 / (1.0 - ctx.p), ctx.p
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        delta = (dout.float() * out.float()).sum(-1)  # [b, h, s] = rowsum(dp * dropped probs)
        for i in range(b):
            for head in range(h):
                kv = head // group
                probs = torch.exp(_scores(q[i, head], k[i, kv], ctx.softmax_scale, ctx.causal) - lse[i, head, :, None])
                keep = attention_keep_mask(ctx.seed, ctx.offset, b, h, s, p, q.device, i, head)
                do = dout[i, head].float()
                dv[i, kv] += torch.matmul(torch.where(keep, probs * scale, 0.0).t(), do)
                dp = torch.where(keep, torch.matmul(do, v[i, kv].float().t()) * scale, 0.0)
                ds = probs * (dp - delta[i, head, :, None])  # [s, s]
                dq[i, head] = torch.matmul(ds, k[i, kv].float()) * ctx.softmax_scale
                dk[i, kv] += torch.matmul(ds.t(), q[i, head].float()) * ctx.softmax_scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def attention_dropout_torch(q, k, v, causal: bool, softmax_scale: float, p: float, seed: int,
                            offset: int) -> torch.Tensor:
    """The reference's function, keeping no per-score tensor for backward (see the module doc)."""
    return _AttentionDropoutFunction.apply(q, k, v, causal, softmax_scale, p, seed, offset)
