"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections, a RoPE key
shared by the heads, d_qk != d_v. The shapes and names: megalite/config/mla.py.

It is a block's attention like model/transformer.py's `Attention`: `qkv(x)` (the projections, a tuple),
`core(q, kv, k_pe, rope, rng[, documents])` (what selective recompute re-runs) and `proj` (the row-parallel output).

Under tp the heads split: the up-projections W_qb, W_kvb (and W_q without a query latent) are
column-parallel over the heads, the output projection row-parallel; the down-projections W_qa, W_kva
and the two latent norms are replicated, each tp rank computing the same latents:
- without SP the latents' gradients are summed over tp where they enter the column-parallel layers
  (their input region) and the shared RoPE key's by its own copy region: every rank's down-projection
  gradient is then the whole one, like any replicated weight's;
- under SP each rank projects its own [s/tp, b, h] tokens; the column-parallel layers gather the
  (narrow) latents, the RoPE key is gathered with a reduce-scatter backward, and the down-projections'
  and norms' gradients, from this rank's tokens only, are declared `sequence_parallel_grad` (summed over
  tp by the data-parallel wrapper, as the SP norms' are).

RoPE runs on the decoupled d_rope channels of each query head and of the shared key, in DeepSeek's
interleaved pair layout (x0, x1), (x2, x3)...: the pairs are de-interleaved to [evens; odds] and rotated
rotate-half, as transformers' DeepseekV3 does; the q.k products are those of the pair rotation.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megalite import ops
from megalite.distributed import comm
from megalite.parameters import params
from megalite.config.model import GPTConfig
from megalite.config.rope_scaling import softmax_scale_factor
from megalite.context_parallel.attention import context_parallel_attention
from megalite.context_parallel.checks import check_attention
from megalite.distributed.layer_groups import LayerGroups
from megalite.kernels import DocumentMask
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, linear
from megalite.tensor_parallel.mlp import normal_init
from megalite.tensor_parallel.random import TensorParallelRNG


class LatentNorm(nn.Module):
    """RMSNorm over a latent [..., r], weight [r] replicated over tp (partial gradients under SP)."""

    def __init__(self, width: int, eps: float, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = params.declare(nn.Parameter(torch.ones(width, dtype=dtype, device=device)),
                                     sequence_parallel_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def _replicated_weight(rows: int, cols: int, std: float, sequence_parallel: bool, dtype, device) -> nn.Parameter:
    """A down-projection [rows, cols], drawn whole on every rank (the same values at every layout)."""
    full = torch.empty(rows, cols)
    nn.init.normal_(full, mean=0.0, std=std)
    weight = nn.Parameter(full.to(device=device, dtype=dtype or torch.get_default_dtype()))
    return params.declare(weight, sequence_parallel_grad=sequence_parallel)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3)... -> [x0, x2, ...; x1, x3, ...]: rotate-half's layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiLatentAttention(nn.Module):
    """groups.tp: the heads split; groups.cp: the sequence's other ranks (ring attention, cp_comm_type
    "p2p", or Ulysses, "a2a", with d_qk != d_v: megalite/context_parallel/); layer_number: the block's global
    index. Parameters: q_down [r_q, h], q_norm [r_q], q_up [n/tp * d_qk, r_q]
    (or q_up [n/tp * d_qk, h] without a query latent), kv_down [r_kv + d_rope, h], kv_norm [r_kv],
    kv_up [n/tp * (d_nope + d_v), r_kv], proj [h, n/tp * d_v]."""

    def __init__(self, config: GPTConfig, groups: LayerGroups, *, sequence_parallel: bool, cp_comm_type: str = "p2p",
                 layer_number: int = 0, dtype=None, device=None):
        super().__init__()
        mla, h, n = config.mla, config.hidden_size, config.num_attention_heads
        tp_group = groups.tp
        self.mla, self.layer_number, self.tp_group = mla, layer_number, tp_group
        self.cp_group, self.cp_comm_type = groups.cp, cp_comm_type
        check_attention(comm.group_size(groups.cp), cp_comm_type, n, n, comm.group_size(tp_group))
        self.sequence_parallel = sequence_parallel
        self.local_heads = n // comm.group_size(tp_group)
        self.softmax_scale = softmax_scale_factor(config.rope_scaling) / math.sqrt(mla.qk_dim)
        init = normal_init(config.init_std)
        column = dict(bias=False, tp_group=tp_group, sequence_parallel=sequence_parallel, init_method=init,
                      dtype=dtype, device=device)
        self.q_down = self.q_norm = None
        if mla.q_lora_rank is None:
            self.q_up = ColumnParallelLinear(h, n * mla.qk_dim, **column)
        else:
            self.q_down = _replicated_weight(mla.q_lora_rank, h, config.init_std, sequence_parallel, dtype, device)
            self.q_norm = LatentNorm(mla.q_lora_rank, config.norm_eps, sequence_parallel, dtype, device)
            self.q_up = ColumnParallelLinear(mla.q_lora_rank, n * mla.qk_dim, **column)
        self.kv_down = _replicated_weight(mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h, config.init_std,
                                          sequence_parallel, dtype, device)
        self.kv_norm = LatentNorm(mla.kv_lora_rank, config.norm_eps, sequence_parallel, dtype, device)
        self.kv_up = ColumnParallelLinear(mla.kv_lora_rank, n * (mla.qk_head_dim + mla.v_head_dim), **column)
        self.proj = RowParallelLinear(n * mla.v_head_dim, h, bias=False, tp_group=tp_group,
                                      sequence_parallel=sequence_parallel,
                                      init_method=normal_init(config.init_std / math.sqrt(2 * config.num_layers)),
                                      dtype=dtype, device=device)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [s', b, h] (s' = s/tp under SP) -> q [s, b, n/tp, d_qk], kv [s, b, n/tp, d_nope + d_v],
        k_pe [s, b, 1, d_rope] (before RoPE)."""
        mla, heads = self.mla, self.local_heads
        if self.q_down is None:
            q = self.q_up(x)
        else:
            q = self.q_up(self.q_norm(linear(x, self.q_down)))  # [s', b, r_q] -> [s, b, n/tp * d_qk]
        latent, k_pe = linear(x, self.kv_down).split([mla.kv_lora_rank, mla.qk_pos_emb_head_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(latent))  # [s', b, r_kv] -> [s, b, n/tp * (d_nope + d_v)]
        if self.sequence_parallel:  # [s/tp, b, d_rope] -> [s, b, d_rope]; backward sums the heads' parts
            k_pe = mappings.gather_from_sequence_parallel_region(k_pe, self.tp_group, grad_is_partial=True)
        else:  # every rank's heads use it: their gradients summed over tp
            k_pe = mappings.copy_to_tensor_parallel_region(k_pe, self.tp_group)
        s, b = q.shape[:2]
        return (q.view(s, b, heads, mla.qk_dim), kv.view(s, b, heads, mla.qk_head_dim + mla.v_head_dim),
                k_pe.reshape(s, b, 1, mla.qk_pos_emb_head_dim))

    def heads(self, q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv()'s (q, kv, k_pe) -> each head's q, k [s, b, n/tp, d_qk] (RoPE on the position channels, the
        shared RoPE key joined to every head's key) and v [s, b, n/tp, d_v]; rope: [s, d] or [s, b, d] tables
        (the generation cache's keys and values too: megalite/generation/cache.py)."""
        mla = self.mla
        s, b = q.shape[:2]
        q_nope, q_pe = q.split([mla.qk_head_dim, mla.qk_pos_emb_head_dim], dim=-1)
        k_nope, v = kv.split([mla.qk_head_dim, mla.v_head_dim], dim=-1)
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        if rope is not None:
            q_pe, k_pe = ops.rope(q_pe, *rope), ops.rope(k_pe, *rope)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [s, b, n/tp, d_qk]
        k = torch.cat([k_nope, k_pe.expand(s, b, self.local_heads, mla.qk_pos_emb_head_dim)], dim=-1)
        return q, k, v

    def core(self, q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor] | None, rng: TensorParallelRNG,
             documents: DocumentMask | None = None) -> torch.Tensor:
        """qkv()'s (q, kv, k_pe) -> [s, b, n/tp * d_v]: RoPE on the position channels, the heads' keys,
        attention. documents: the microbatch's packed documents and/or window (GPTModel builds it), or None."""
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in self.heads(q, kv, k_pe, rope))  # -> [b, heads, s, d]
        if comm.group_size(self.cp_group) > 1:  # s = s/cp: this rank's zigzag chunks, RoPE at their positions
            out = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, documents=documents,
                                             softmax_scale=self.softmax_scale)  # [b, n/tp, s/cp, d_v]
        else:
            out = ops.latent_attention(q, k, v, self.softmax_scale, documents)  # [b, n/tp, s, d_v]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.mla.v_head_dim)
