"""Ring attention: causal self-attention over a sequence split across the context-parallel ring.

Liu et al. 2023, "Ring attention with blockwise transformers"; load-balanced by the zigzag
split (zigzag.py). Each cp rank keeps its queries and passes its keys/values round the ring:

    forward, step t = 0 .. cp-1 (rank i holds the K/V of rank i - t):
        post: send the held K/V to rank i+1, receive the next from rank i-1   (in flight ...)
        compute this step's blocks (blocks.py: full, diagonal or skipped) -> (o_t, lse_t)
        merge into the running (out, lse) by log-sum-exp                     (... meanwhile)
        wait for the next K/V
    backward, same ring: each step computes the blocks' dq (kept) and dK/dV for the held K/V;
        dK/dV accumulators travel with their K/V (one hop behind it) and a last hop brings
        every rank its own.

Only K/V travel, with their kv heads (grouped-query attention sends h_kv, not h, heads),
packed side by side as one [b, h_kv, s/cp, d_qk + d_v] message per step (d_qk: the keys' head dim,
d_v: the values'; multi-head latent attention has d_qk > d_v, and the output, its running accumulator
and dq/dv take their own). Every transfer goes through `megalite.distributed.comm.batch_isend_irecv`
on the cp group, so the ledger counts, per call, with D = d_qk + d_v (2d for ordinary attention),

    forward   send = recv = (cp - 1) * b * h_kv * (s/cp) * D * itemsize
    backward  send = recv = (cp - 1) * b * h_kv * (s/cp) * D * itemsize    (K/V again)
                          +  cp      * b * h_kv * (s/cp) * D * 4           (fp32 dK/dV)

(b, h_kv: this rank's batch and kv heads; s/cp its local tokens). The per-block attention is
block_attention.py's: Triton flash attention on CUDA (d_qk = d_v), PyTorch elsewhere. Packed
documents and windows (documents.py) skip the blocks that share no document and mask the rest (on
CUDA the causal calls on the varlen kernels, masked full blocks in PyTorch); under the per-document
split (--cp-split documents, a SplitDocumentMask) each step computes every document's box of visible
pairs instead (split_calls.py). The transfers stay the same (every rank's K/V still visits every rank).
"""
from __future__ import annotations

import math

import torch

from megalite.distributed import comm
from megalite.context_parallel.block_attention import block_backward, block_forward, merge_block
from megalite.context_parallel.blocks import BlockCall, ring_plan, ring_source
from megalite.context_parallel.document_split import SplitDocumentMask
from megalite.context_parallel.documents import RingDocuments, check_whole_sequence, local_documents
from megalite.context_parallel.split_calls import RingSplit
from megalite.kernels import DocumentMask


def _shift_forward(tensor: torch.Tensor, group, ranks: list[int], me: int):
    """Post: send `tensor` to the next rank of the ring, receive the previous rank's. -> (buffer, handles)."""
    cp = len(ranks)
    received = torch.empty_like(tensor)
    handles = comm.batch_isend_irecv([comm.P2P("send", tensor, ranks[(me + 1) % cp]),
                                      comm.P2P("recv", received, ranks[(me - 1) % cp])], group)
    return received, handles


def _arrived(pending) -> torch.Tensor:
    received, handles = pending
    comm.wait_all(handles)
    return received


def _rows(call: BlockCall, chunk: int) -> tuple[slice, slice]:
    """(query rows, key rows) of a call, as slices of the local sequence dim."""
    return slice(call.q_start * chunk, call.q_stop * chunk), slice(call.kv_start * chunk, call.kv_stop * chunk)


_ALL = slice(None)  # a call over every sample of the microbatch


def _computed(calls: list[BlockCall], chunk: int, mine: RingDocuments | None, source: int):
    """(samples, rows, cols, causal, mask or None) of each call as computed: without documents the call's
    rows, with them what RingDocuments.call keeps of it (documents.py; a call that sees nothing is dropped)."""
    for call in calls:
        rows, cols = _rows(call, chunk)
        kept = (rows, cols, None) if mine is None else mine.call(rows, cols, source, call.causal)
        if kept is not None:
            yield _ALL, kept[0], kept[1], call.causal, kept[2]


def _schedule(documents: DocumentMask | None, me: int, cp: int, layout: str, chunk: int) -> list[list]:
    """Each ring step's calls, (samples, rows, cols, causal, mask or None): the zigzag plan (blocks.py),
    cropped by the documents (documents.py), or under the per-document split its documents' boxes
    (split_calls.py), built once per microbatch. The backward runs the forward's calls."""
    if isinstance(documents, SplitDocumentMask):  # the same calls in every layer: built once per microbatch
        return documents.memo(("ring", me, cp), lambda: RingSplit(documents, cp_rank=me, cp=cp).schedule())
    mine = local_documents(documents, me, cp, layout=layout)  # None without documents or a window
    plan = ring_plan(me, cp, layout, visible=mine.visible if mine else None)
    return [list(_computed(calls, chunk, mine, ring_source(me, step, cp))) for step, calls in enumerate(plan)]


def _split(kv: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, h_kv, s/cp, d_qk + d_v] -> views (k [..., d_qk], v [..., d_v]) of one ring message."""
    return kv[..., :key_dim], kv[..., key_dim:]


class RingAttention(torch.autograd.Function):
    """q [b, h, s/cp, d_qk], k [b, h_kv, s/cp, d_qk], v [b, h_kv, s/cp, d_v] (this rank's zigzag chunks)
    -> out [b, h, s/cp, d_v]."""

    @staticmethod
    def forward(ctx, q, k, v, cp_group, layout: str, softmax_scale: float, documents: DocumentMask | None):
        cp, me, ranks = comm.group_size(cp_group), comm.group_rank(cp_group), comm.group_ranks(cp_group)
        schedule = _schedule(documents, me, cp, layout, q.shape[2] // 2)
        kv = torch.cat([k, v], dim=-1)  # [b, h_kv, s/cp, d_qk + d_v]: one message per step
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)  # [b, h, s/cp, d_v]
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step, calls in enumerate(schedule):
            pending = _shift_forward(kv, cp_group, ranks, me) if step < cp - 1 else None
            held_k, held_v = _split(kv, q.shape[-1])
            for samples, rows, cols, causal, mask in calls:  # overlaps the transfer just posted
                block_out, block_lse = block_forward(q[samples, :, rows], held_k[samples, :, cols],
                                                     held_v[samples, :, cols], causal, softmax_scale, mask)
                merge_block(out[samples, :, rows], lse[samples, :, rows], block_out, block_lse)
            if pending is not None:
                kv = _arrived(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp_group, ctx.softmax_scale, ctx.schedule = cp_group, softmax_scale, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.cp_group, ctx.softmax_scale
        cp, me, ranks = comm.group_size(group), comm.group_rank(group), comm.group_ranks(group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        dkv_pending = None  # the dK/dV accumulator of the K/V held next, coming from the previous rank
        for step, calls in enumerate(ctx.schedule):
            kv_pending = _shift_forward(kv, group, ranks, me) if step < cp - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # for the held K/V
            (held_k, held_v), (dk, dv) = _split(kv, q.shape[-1]), _split(dkv, q.shape[-1])
            for samples, rows, cols, causal, mask in calls:
                dq_block, dk_block, dv_block = block_backward(
                    q[samples, :, rows], held_k[samples, :, cols], held_v[samples, :, cols], out[samples, :, rows],
                    dout[samples, :, rows], lse[samples, :, rows], causal, scale, mask)
                dq[samples, :, rows] += dq_block
                dk[samples, :, cols] += dk_block
                dv[samples, :, cols] += dv_block
            if dkv_pending is not None:
                dkv += _arrived(dkv_pending)  # what earlier ranks added to the same K/V
            if cp > 1:  # on to the rank that holds this K/V next; after the last step, to its owner
                dkv_pending = _shift_forward(dkv, group, ranks, me)
            if kv_pending is not None:
                kv = _arrived(kv_pending)
        if dkv_pending is not None:
            dkv = _arrived(dkv_pending)
        dk, dv = _split(dkv, q.shape[-1])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group,
                   softmax_scale: float | None = None, layout: str = "zigzag", *,
                   documents: DocumentMask | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence split across `cp_group`.

    q and k [b, h(_kv), s/cp, d_qk], v [b, h_kv, s/cp, d_v]: this rank's two chunks of the sequence
    (zigzag.split_sequence order), or with a SplitDocumentMask `documents` its tokens of the per-document
    split (document_split.local_tokens order), h % h_kv == 0. Returns this rank's rows of softmax(q k^T
    * scale + causal mask) v over all s keys, [b, h, s/cp, d_v] in q's dtype; differentiable.
    softmax_scale None: 1/sqrt(d_qk). With `cp_group` None (one rank) it is plain causal attention.
    documents: the whole sequence's packed documents and/or window ([b, s] mask, global
    positions; context_parallel/documents.py): blocks outside them are skipped, the rest masked.
    """
    if (q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[2] != q.shape[2]
            or k.shape[3] != q.shape[3]):
        raise ValueError(f"ring_attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not "
                         "fit q [b, h, s/cp, d_qk], k [b, h_kv, s/cp, d_qk], v [b, h_kv, s/cp, d_v]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[2] % 2:
        raise ValueError(f"ring_attention: the local sequence ({q.shape[2]} tokens) must be two equal chunks "
                         "(zigzag.split_sequence); make the sequence length a multiple of 2*cp")
    if documents is not None:
        check_whole_sequence(documents, q.shape[2], comm.group_size(cp_group))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(q, k, v, cp_group, layout, float(scale), documents)
