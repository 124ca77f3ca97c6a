"""One transformer block built from megalite's tensor-parallel layers, both flavours.

Activations are [s, b, h] (Megatron's layout: the sequence dim leads, so sequence-parallel
scatter/gather are contiguous). With sequence parallelism the block's input and output are the
sequence shard [s/tp, b, h]: norms, dropouts and residual adds run on the shard, the
column-parallel layers all-gather the sequence, the row-parallel layers reduce-scatter it.
With context parallelism (a cp group of more than one rank) s is this cp rank's s/cp tokens
(its zigzag chunks) and only the attention core talks to the other cp ranks.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megalite import ops
from megalite.distributed import comm
from megalite.parameters import params
from megalite.context_parallel.attention import context_parallel_attention
from megalite.context_parallel.checks import check_attention
from megalite.context_parallel.document_split import SplitDocumentMask
from megalite.context_parallel.zigzag import logical_row_offsets
from megalite.kernels import DocumentMask
from megalite.distributed.layer_groups import LayerGroups
from megalite.config.model import GPTConfig
from megalite.model.mla import MultiLatentAttention
from megalite.model.recompute import checkpoint_with_rng
from megalite.moe.layer import MoELayer
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.tensor_parallel.mlp import MLP, normal_init, zeros_init
from megalite.tensor_parallel.random import TensorParallelRNG, dropout, dropout_site


class Norm(nn.Module):
    """LayerNorm (gpt2) or RMSNorm (llama) over the last dim; weights replicated across tp.

    Under sequence parallelism each tp rank sees a different sequence shard, so these
    parameters' gradients are partial sums: they are declared `sequence_parallel_grad` and the
    data-parallel wrapper all-reduces them over tp.
    """

    def __init__(self, config: GPTConfig, sequence_parallel: bool, dtype=None, device=None):
        super().__init__()
        h = config.hidden_size
        self.kind, self.eps = ("layer" if config.flavour == "gpt2" else "rms"), config.norm_eps
        self.weight = params.declare(nn.Parameter(torch.ones(h, dtype=dtype, device=device)),
                                     sequence_parallel_grad=sequence_parallel)
        if self.kind == "layer":
            self.bias = params.declare(nn.Parameter(torch.zeros(h, dtype=dtype, device=device)),
                                       sequence_parallel_grad=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return ops.layer_norm(x, self.weight, self.bias, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)


class HeadNorm(nn.Module):
    """RMSNorm over the last dim d of [s, b, heads, d] with one weight [d] shared by all heads (Qwen3's
    q/k norms). Replicated across tp; with tp > 1 each rank's heads give part of its gradient, so it is
    declared `sequence_parallel_grad` (summed over tp by the data-parallel wrapper, as SP norms are)."""

    def __init__(self, head_dim: int, eps: float, partial_grad: bool, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = params.declare(nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device)),
                                     sequence_parallel_grad=partial_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention: fused QKV column-parallel linear -> (RoPE) -> causal core -> row-parallel out.

    The QKV weight's full layout is [Q; K; V] (as HF stores it) with each block split across tp,
    so rank r owns query heads [r*nq/tp, (r+1)*nq/tp) and the key/value groups they use.
    With a cp group of more than one rank the core is ring attention (cp_comm_type "p2p") or
    Ulysses ("a2a") over the cp ranks' chunks of the sequence.

    groups: the LayerGroups it talks over (groups.tp: heads split; groups.cp: the sequence's other
    chunks); layer_number: the block's global index (its dropout sites).
    """

    def __init__(self, config: GPTConfig, groups: LayerGroups, *, sequence_parallel: bool,
                 cp_comm_type: str = "p2p", layer_number: int = 0, dtype=None, device=None):
        super().__init__()
        tp_group = groups.tp
        tp = comm.group_size(tp_group)
        self.cp_group, self.cp_comm_type = groups.cp, cp_comm_type
        check_attention(comm.group_size(groups.cp), cp_comm_type, config.num_attention_heads, config.num_query_groups,
                        tp, config.attention_dropout)
        d, nq, nkv = config.head_dim, config.num_attention_heads, config.num_query_groups
        self.config, self.layer_number, self.tp_rank = config, layer_number, comm.group_rank(tp_group)
        self.local_heads, self.local_groups, self.head_dim = nq // tp, nkv // tp, d
        init = normal_init(config.init_std)
        out_init = normal_init(config.init_std / math.sqrt(2 * config.num_layers))
        self.qkv = ColumnParallelLinear(config.hidden_size, (nq + 2 * nkv) * d, bias=config.qkv_bias,
                                        tp_group=tp_group, sequence_parallel=sequence_parallel, init_method=init,
                                        bias_init_method=zeros_init, fused_blocks=(nq * d, nkv * d, nkv * d),
                                        dtype=dtype, device=device)
        self.proj = RowParallelLinear(nq * d, config.hidden_size, bias=config.proj_bias, tp_group=tp_group,
                                      sequence_parallel=sequence_parallel, init_method=out_init,
                                      bias_init_method=zeros_init, dtype=dtype, device=device)
        if config.qk_layernorm:  # Qwen3: RMSNorm over each head's d channels; a rank's heads see part of the grad
            self.q_norm = HeadNorm(d, config.norm_eps, tp > 1, dtype, device)
            self.k_norm = HeadNorm(d, config.norm_eps, tp > 1, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def core(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
             rng: TensorParallelRNG, documents: DocumentMask | None = None) -> torch.Tensor:
        """[s, b, (nq + 2 nkv)/tp * d] -> [s, b, nq/tp * d]: the part selective recompute re-runs.
        documents: the microbatch's packed documents (GPTModel.forward builds it once), or None."""
        s, b, _ = qkv.shape
        d, hq, hkv = self.head_dim, self.local_heads, self.local_groups
        q, k, v = ops.split_heads(qkv, (hq, hkv, hkv), d)  # views [s, b, heads, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = ops.rope(q, *rope), ops.rope(k, *rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, heads, d] -> [b, heads, s, d]
        p = self.config.attention_dropout if self.training else 0.0
        seed = rng.tensor_parallel.draw(dropout_site(self.layer_number, 0)) if p > 0.0 else 0
        head_start = self.tp_rank * hq  # this rank's heads of the logical [nq, b, s, s] probabilities
        if comm.group_size(self.cp_group) > 1:  # the other cp ranks hold the rest of the sequence
            out = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, p, seed, head_start,
                                             documents=documents)  # the whole sequence's mask
        else:
            out = ops.attention(q, k, v, dropout_p=p, dropout_seed=seed,
                               dropout_offset=head_start * b * s * s, documents=documents)  # [b, hq, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

    groups: the LayerGroups this block talks over (tp, cp; for an MoE block also ep, moe_tokens,
    experts_whole). With `config.moe` and `config.moe.is_moe_layer(layer_number)` the MLP is a
    mixture of experts (`megalite.moe.layer.MoELayer`, sharded over groups.ep).

    `layer_number` is the block's global index in the model: it names the block's dropout sites,
    so its masks are the same on whichever pipeline stage it runs (tensor_parallel/random.py).
    """

    def __init__(self, config: GPTConfig, groups: LayerGroups, *, sequence_parallel: bool, cp_comm_type: str = "p2p",
                 layer_number: int = 0, moe_dispatcher: str = "alltoall", dtype=None, device=None):
        super().__init__()
        tp_group, cp_group = groups.tp, groups.cp
        self.config, self.sequence_parallel, self.layer_number = config, sequence_parallel, layer_number
        self.tp_group, self.tp_rank = tp_group, comm.group_rank(tp_group)
        self.cp_size, self.cp_rank = comm.group_size(cp_group), comm.group_rank(cp_group)  # this rank's tokens
        self.input_norm = Norm(config, sequence_parallel, dtype, device)
        if config.mla is not None:  # DeepSeek's latent attention: the same qkv / core / proj steps
            self.attention = MultiLatentAttention(config, groups, sequence_parallel=sequence_parallel,
                                                  cp_comm_type=cp_comm_type, layer_number=layer_number, dtype=dtype,
                                                  device=device)
        else:
            self.attention = Attention(config, groups, sequence_parallel=sequence_parallel,
                                       cp_comm_type=cp_comm_type, layer_number=layer_number, dtype=dtype,
                                       device=device)
        self.post_attention_norm = Norm(config, sequence_parallel, dtype, device)
        self.is_moe = config.moe is not None and config.moe.is_moe_layer(layer_number)
        if self.is_moe:
            self.mlp = MoELayer(config, groups, sequence_parallel=sequence_parallel, moe_dispatcher=moe_dispatcher,
                                layer_number=layer_number, dtype=dtype, device=device)
        else:
            self.mlp = MLP(config, tp_group, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.recompute_core = False  # selective recompute: re-run the attention core in backward

    def _bias_dropout_add(self, bias: torch.Tensor | None, y: torch.Tensor, residual: torch.Tensor,
                          rng: TensorParallelRNG, which: int) -> torch.Tensor:
        """residual + dropout(y + projection.bias) in one kernel, keeping nothing for backward.

        The logical mask is the [s, b, h] activation's (replicated stream): without SP every tp
        rank builds all of it, under SP rank r builds its rows [r*s/tp, (r+1)*s/tp)."""
        shards = comm.group_size(self.tp_group) if self.sequence_parallel else 1
        row_numel = math.prod(residual.shape[1:])  # not residual[0].numel(): an aten op per call to read a size
        offset = logical_row_offsets(residual.shape[0], row_numel, self.tp_rank if shards > 1 else 0,
                                     shards, self.cp_rank, self.cp_size)
        return dropout(y, self.config.hidden_dropout, rng.replicated, dropout_site(self.layer_number, which),
                       self.training, offset, bias=bias, residual=residual)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                rng: TensorParallelRNG, documents: DocumentMask | None = None) -> torch.Tensor:
        qkv = self.attention.qkv(self.input_norm(x))
        qkv = qkv if isinstance(qkv, tuple) else (qkv,)  # latent attention's core takes three tensors
        masked = (documents,) if documents is not None else ()  # packed documents and/or a window
        if self.recompute_core and self.training:  # (as tensors, which the checkpoint keeps visibly)
            core = checkpoint_with_rng(self.attention.core, rng, *qkv, rope, rng, *masked)
        else:
            core = self.attention.core(*qkv, rope, rng, *masked)
        proj = self.attention.proj
        x = self._bias_dropout_add(proj.bias, proj(core, add_bias=False), x, rng, 1)
        if self.is_moe:  # experts carry no biases; a capacity reads the per-document cp split's token order
            split_order = documents.order if isinstance(documents, SplitDocumentMask) else None
            return self._bias_dropout_add(None, self.mlp(self.post_attention_norm(x), split_order), x, rng, 2)
        return self._bias_dropout_add(self.mlp.fc2.bias, self.mlp(self.post_attention_norm(x), add_bias=False), x,
                                      rng, 2)
