"""The model's entry to context-parallel attention: ring (p2p) or Ulysses (a2a), by name."""
from __future__ import annotations

import torch

from megalite.config.choices import CPCommType
from megalite import ops
from megalite.distributed import comm
from megalite.context_parallel.checks import CP_COMM_TYPES
from megalite.context_parallel.ring import ring_attention
from megalite.context_parallel.ulysses import ulysses_attention


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, comm_type: str = "p2p",
                               dropout_p: float = 0.0, dropout_seed: int = 0, head_start: int = 0) -> torch.Tensor:
    """Causal attention of this rank's zigzag chunks over the sequence split across `cp_group`.

    q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d] -> [b, h, s/cp, d]. comm_type "p2p": ring
    attention (K/V blocks round the ring); "a2a": Ulysses (all-to-all to a head split and back).
    Dropout (Ulysses only): the Philox mask of `dropout_seed` over the logical [heads, b, s, s]
    probabilities, of which q's heads start at global head `head_start`.
    With a cp group of one rank (or None) it is plain causal attention over the whole sequence,
    so a user's block can call it at every layout.
    """
    if comm.group_size(cp_group) == 1:
        b, _, s, _ = q.shape
        return ops.attention(q, k, v, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=head_start * b * s * s)
    if comm_type == CPCommType.P2P:
        if dropout_p > 0.0:
            raise ValueError(f"attention dropout {dropout_p} is not supported by ring attention; set "
                             "attention_dropout=0 or use --cp-comm-type a2a")
        return ring_attention(q, k, v, cp_group)
    if comm_type == CPCommType.A2A:
        return ulysses_attention(q, k, v, cp_group, dropout_p=dropout_p, dropout_seed=dropout_seed,
                                 head_start=head_start)
    raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {CP_COMM_TYPES}")
