"""Ulysses context parallelism: trade the sequence split for a head split around attention.

Jacobs et al. 2023, "DeepSpeed Ulysses". Each cp rank holds s/cp tokens of every (local) head.
One all-to-all regroups the attention inputs so that each rank holds every token of h/cp heads,
ordinary causal attention runs on whole sequences, and one all-to-all puts the output back:

    q, k, v [b, h(_kv), s/cp, d]  --all-to-all-->  [b, h(_kv)/cp, s, d]  --attention-->
    out [b, h/cp, s, d]           --all-to-all-->  [b, h, s/cp, d]

q, k and v travel in one all-to-all (each rank's piece: its head groups of q, k and v, flattened
and packed side by side, so the values may be narrower than the queries and keys: multi-head latent
attention's d_v < d_qk). The tokens arrive rank by rank, each rank's two zigzag chunks; they are put
in sequence order before attention and back after. Packed documents and windows: the whole sequence's
mask goes to that attention. Heads (and kv heads) per rank must divide by cp (checks.py says what to
change).

Bytes in the ledger per call (comm's convention for all_to_all: the input, own piece included),
with b, h, h_kv this rank's batch and heads, s/cp its tokens and d = d_qk = d_v (else each tensor
with its own head dim):

    forward   (h + 2 h_kv) * b * (s/cp) * d * itemsize  +  h * b * (s/cp) * d * itemsize
    backward  the same two, in the other order (an all-to-all's gradient is an all-to-all)
"""
from __future__ import annotations

import torch

from megalite import ops
from megalite.distributed import comm
from megalite.context_parallel.document_split import SplitDocumentMask, check_split
from megalite.context_parallel.documents import check_whole_sequence
from megalite.context_parallel.zigzag import chunk_ids
from megalite.kernels import DocumentMask


class _AllToAll(torch.autograd.Function):
    """[cp, ...] -> [cp, ...]: piece r goes to cp rank r; piece r received comes from rank r.

    With equal pieces the exchange is its own adjoint, so backward is the same all-to-all.
    """

    @staticmethod
    def forward(ctx, pieces: torch.Tensor, group):
        ctx.group = group
        pieces = pieces.contiguous()
        return comm.all_to_all(torch.empty_like(pieces), pieces, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return comm.all_to_all(torch.empty_like(grad), grad, ctx.group), None


def _chunk_order(cp: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_sequence, to_ranks): index maps between rank-major chunks (rank r's two, in order) and
    sequence order, so that sequence_chunks = rank_chunks[to_sequence], rank_chunks = sequence_chunks[to_ranks]."""
    to_ranks = torch.tensor([c for r in range(cp) for c in chunk_ids(r, cp, layout)])
    return torch.argsort(to_ranks), to_ranks


def _rank_major(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk maps of the per-document split: the ranks' tokens stay rank-major (reordered per sample
    by `_tokens_in_order`)."""
    return torch.arange(2 * cp), torch.arange(2 * cp)


def _tokens_in_order(x: torch.Tensor, order: torch.Tensor | None, *, back: bool = False) -> torch.Tensor:
    """[b, H, s, d] with the ranks' tokens rank-major (position order[:, i] at i) -> sequence order; back:
    the inverse. The identity without the per-document split (order None)."""
    if order is None:
        return x
    index = order.to(x.device)[:, None, :, None].expand_as(x)
    return x.gather(2, index) if back else torch.empty_like(x).scatter(2, index, x)


def _to_head_groups(tensors: tuple[torch.Tensor, ...], cp: int) -> torch.Tensor:
    """q, k, v [b, heads, s/cp, d_t] -> [cp, b, n]: piece r holds head group r of each, flattened, side by side."""
    return torch.cat([t.reshape(t.shape[0], cp, -1).transpose(0, 1) for t in tensors], dim=2)


def _from_head_groups(received: torch.Tensor, like: tuple[torch.Tensor, ...], cp: int) -> list[torch.Tensor]:
    """[cp, b, n] (source rank r: its tokens of my head group) -> per tensor of `like` [cp, b, heads/cp, 2, c, d_t]."""
    sizes = [t.shape[1] // cp * t.shape[2] * t.shape[3] for t in like]
    pieces = received.split(sizes, dim=2)
    return [piece.reshape(cp, t.shape[0], t.shape[1] // cp, 2, t.shape[2] // 2, t.shape[3])
            for piece, t in zip(pieces, like)]


def _heads_to_sequence_order(received: torch.Tensor, to_sequence: torch.Tensor) -> torch.Tensor:
    """[cp, b, H, 2, c, d] (source rank, its two chunks) -> [b, H, 2 cp c, d] in sequence order."""
    cp, b, heads, _, c, d = received.shape
    chunks = received.permute(0, 3, 1, 2, 4, 5).reshape(2 * cp, b, heads, c, d)  # rank-major chunks
    chunks = chunks.index_select(0, to_sequence.to(received.device))
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, heads, 2 * cp * c, d)


def _sequence_to_rank_order(x: torch.Tensor, cp: int, to_ranks: torch.Tensor) -> torch.Tensor:
    """[b, H, s, d] in sequence order -> [cp, b, H, s/cp, d]: piece r holds rank r's two chunks."""
    b, heads, s, d = x.shape
    c = s // (2 * cp)
    chunks = x.reshape(b, heads, 2 * cp, c, d).index_select(2, to_ranks.to(x.device))  # rank-major chunks
    return chunks.reshape(b, heads, cp, 2 * c, d).permute(2, 0, 1, 3, 4)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, dropout_p: float = 0.0,
                      dropout_seed: int = 0, head_start: int = 0, layout: str = "zigzag", *,
                      documents: DocumentMask | None = None, softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence split across `cp_group`, by head-sharding all-to-alls.

    q and k [b, h(_kv), s/cp, d_qk], v [b, h_kv, s/cp, d_v]: this rank's two chunks (zigzag.split_sequence
    order), or with a SplitDocumentMask its tokens of the per-document split (document_split.local_tokens).
    Returns this rank's rows [b, h, s/cp, d_v]; differentiable. The attention itself is
    `megalite.ops.attention` (Triton flash attention on CUDA), dropout included; with d_qk != d_v or a
    `softmax_scale` (multi-head latent attention, no dropout) `megalite.ops.latent_attention`. Dropout:
    after the all-to-all this rank holds heads [cp_rank*h/cp, (cp_rank+1)*h/cp) of q's heads over
    the whole sequence in order, so its part of the logical Philox mask (q's heads start at
    global head `head_start`) is at those heads' counters, the same as without cp.
    documents: the whole sequence's packed documents and/or window ([b, s] mask in global
    positions): the local attention runs on whole sequences, so it takes the mask as it is.
    """
    cp = comm.group_size(cp_group)
    b, h, s_local, _ = q.shape
    h_kv, d_v = k.shape[1], v.shape[-1]
    if h % cp or h_kv % cp:
        raise ValueError(f"ulysses_attention: this rank's {h} query heads and {h_kv} kv heads must both divide by "
                         f"cp={cp}; choose a cp that divides both, or use ring attention (--cp-comm-type p2p)")
    if s_local % 2:
        raise ValueError(f"ulysses_attention: the local sequence ({s_local} tokens) must be two equal chunks "
                         "(zigzag.split_sequence); make the sequence length a multiple of 2*cp")
    if documents is not None:
        check_whole_sequence(documents, s_local, cp)
    split = documents.order if isinstance(documents, SplitDocumentMask) else None  # per-document split
    if split is not None:
        check_split(documents, cp)
    to_sequence, to_ranks = _chunk_order(cp, layout) if split is None else _rank_major(cp)
    # [b, heads, s/cp, d_t] -> [cp, b, n]: piece r carries head group r of q, k and v to rank r
    received = _AllToAll.apply(_to_head_groups((q, k, v), cp), cp_group)
    q_full, k_full, v_full = (_tokens_in_order(_heads_to_sequence_order(t, to_sequence), split)  # [b, heads/cp, s, d_t]
                              for t in _from_head_groups(received, (q, k, v), cp))
    s_full = q_full.shape[2]
    if q.shape[-1] != d_v or softmax_scale is not None:  # latent attention: no dropout (refused before)
        out = ops.latent_attention(q_full, k_full, v_full, softmax_scale or q.shape[-1] ** -0.5, documents)
    else:
        first_head = head_start + comm.group_rank(cp_group) * (h // cp)
        out = ops.attention(q_full, k_full, v_full, dropout_p=dropout_p, dropout_seed=dropout_seed,
                            dropout_offset=first_head * b * s_full * s_full, documents=documents)  # [b, h/cp, s, d_v]
    pieces = _sequence_to_rank_order(_tokens_in_order(out, split, back=True), cp, to_ranks)  # [cp, b, h/cp, s/cp, d_v]
    returned = _AllToAll.apply(pieces, cp_group)  # piece r: head group r, my tokens
    return returned.transpose(0, 1).reshape(b, h, s_local, d_v)
