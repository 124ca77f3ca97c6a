"""The model's entry to context-parallel attention: ring (p2p) or Ulysses (a2a), by name."""
from __future__ import annotations

import torch

from megalite.config.choices import CPCommType
from megalite import ops
from megalite.distributed import comm
from megalite.context_parallel.checks import CP_COMM_TYPES
from megalite.context_parallel.ring import ring_attention
from megalite.context_parallel.ulysses import ulysses_attention
from megalite.kernels import DocumentMask


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, comm_type: str = "p2p",
                               dropout_p: float = 0.0, dropout_seed: int = 0, head_start: int = 0, *,
                               documents: DocumentMask | None = None,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag chunks over the sequence split across `cp_group`.

    q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d] -> [b, h, s/cp, d]. Multi-head latent attention
    passes q, k [b, h, s/cp, d_qk], v [b, h, s/cp, d_v] and its `softmax_scale` (None: 1/sqrt(d)),
    and gets [b, h, s/cp, d_v]. comm_type "p2p": ring
    attention (K/V blocks round the ring); "a2a": Ulysses (all-to-all to a head split and back).
    Dropout (Ulysses only): the Philox mask of `dropout_seed` over the logical [heads, b, s, s]
    probabilities, of which q's heads start at global head `head_start`.
    With a cp group of one rank (or None) it is plain causal attention over the whole sequence,
    so a user's block can call it at every layout.
    documents: packed documents and/or a sliding window, the whole sequence's mask ([b, s],
    DocumentMask.from_position_ids of every token's position id; context_parallel/documents.py).
    """
    if comm.group_size(cp_group) == 1:
        if q.shape[-1] != v.shape[-1] or softmax_scale is not None:
            return ops.latent_attention(q, k, v, softmax_scale or q.shape[-1] ** -0.5, documents)
        b, _, s, _ = q.shape
        return ops.attention(q, k, v, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=head_start * b * s * s, documents=documents)
    if comm_type == CPCommType.P2P:
        if dropout_p > 0.0:
            raise ValueError(f"attention dropout {dropout_p} is not supported by ring attention; set "
                             "attention_dropout=0 or use --cp-comm-type a2a")
        return ring_attention(q, k, v, cp_group, softmax_scale, documents=documents)
    if comm_type == CPCommType.A2A:
        return ulysses_attention(q, k, v, cp_group, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                 head_start=head_start, documents=documents, softmax_scale=softmax_scale)
    raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {CP_COMM_TYPES}")
