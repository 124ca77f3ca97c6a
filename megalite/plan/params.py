"""Parameters held per rank and FLOPs per token: pure arithmetic on the model and the layout."""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.choices import Recompute
from megalite.config.model import GPTConfig, attention_span
from megalite.plan.layout import head_stage, stage_layers
from megalite.plan.moe import dense_change_per_layer, expert_params_per_layer, stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def layer_params(model: GPTConfig, tp: int) -> int:
    """Parameters of one transformer block held by one tensor-parallel rank."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    norm = 2 * h if model.flavour == "gpt2" else h            # LayerNorm weight+bias | RMSNorm weight
    mlp_in = f if model.flavour == "gpt2" else 2 * f           # fc1 | fused gate+up
    n = 2 * norm + h * qkv // tp + model.num_attention_heads * d * h // tp
    n += (h * mlp_in + f * h) // tp
    # column-parallel biases are sharded, row-parallel biases replicated; q/k norms [d] replicated
    n += qkv // tp * model.qkv_bias + h * model.proj_bias + (mlp_in // tp + h) * model.mlp_bias
    if model.mla is not None:  # latent attention instead of the fused QKV, output and their biases
        n -= h * qkv // tp + model.num_attention_heads * d * h // tp + qkv // tp * model.qkv_bias + h * model.proj_bias
        n += model.mla.params(h, model.num_attention_heads, tp)
    return n + 2 * d * model.qk_layernorm


def mtp_params(model: GPTConfig, cfg: RunConfig) -> int:
    """DeepSeek's MTP depths on one rank of the last stage: each a block, three norms and M_k [h/tp, 2h]."""
    h, tp = model.hidden_size, cfg.parallel.tp
    n = 0
    for k in range(model.mtp_num_layers):
        n += layer_params(model, tp) + 3 * h + 2 * h * h // tp
        if model.is_moe_block(model.num_layers + k):
            n += dense_change_per_layer(model, cfg) + expert_params_per_layer(model, cfg)
    return n


def stage_params(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Parameters held by one rank of pipeline stage `stage` (padded vocabulary included)."""
    h, tp, pp = model.hidden_size, cfg.parallel.tp, cfg.parallel.pp
    n = stage_layers(model, cfg)[stage] * layer_params(model, tp)
    moe_layers = stage_moe_layers(model, cfg, stage)
    if moe_layers:  # router, local experts and shared expert instead of the dense MLP
        n += moe_layers * (dense_change_per_layer(model, cfg) + expert_params_per_layer(model, cfg))
    vocab_shard = model.padded_vocab_size(tp) // tp * h
    final_norm = 2 * h if model.flavour == "gpt2" else h
    if stage == 0:
        n += vocab_shard + (model.seq_length * h if model.flavour == "gpt2" else 0)
    if stage == head_stage(cfg):  # the last stage; stage 0 under DualPipeV
        n += final_norm + mtp_params(model, cfg)
        # untied: an output layer; tied with pp > 1: the last stage keeps its own copy of the
        # word embedding, kept in sync by an all-reduce of its gradient over the embedding group
        if not model.tie_embeddings or pp > 1:
            n += vocab_shard
        if model.mtp_num_layers and pp > 1 and not model.tie_embeddings:  # MTP's copy of the word embedding
            n += vocab_shard
    return n


def mean_document_length(cfg: RunConfig) -> float | None:
    """The documents attention is counted over: --mean-document-length under --reset-attention-mask, else
    None (each sequence one document)."""
    return cfg.data.mean_document_length if cfg.data.reset_attention_mask else None


def hardware_flops_per_token(model: GPTConfig, recompute: str, seq_length: int | None = None,
                             recompute_fraction: float = 1.0, mean_document_length: float | None = None, *,
                             span: float | None = None) -> float:
    """FLOPs executed per token including recomputation (HFU's numerator).

    Model FLOPs are 6N + 12*L*h*s; selective recompute re-runs the attention core forward
    (4*L*h*s; latent attention's 2*L*n*(d_qk + d_v)*s); full recompute re-runs every block's forward
    GEMMs (2*N_blocks + 4*L*h*s, N_blocks with a token's topk experts; torch's non-reentrant checkpoint
    stops right after the last one, skipping only the MLP output's tp reduction), or that
    `recompute_fraction` of the blocks (--recompute-num-layers). MTP's depths are not recomputed.
    """
    s = seq_length or model.seq_length
    if span is None:  # documents and window: keys per query (measured on a step's documents when given)
        span = attention_span(s, mean_document_length, model.window_size)
    flops = model.flops_per_token(s, span=span)
    attention_forward = 2.0 * model.num_layers * model.scores_width() * span  # 4 L h s without MLA
    if recompute == Recompute.SELECTIVE:
        flops += attention_forward
    elif recompute == Recompute.FULL:  # the blocks re-run (MTP's depths are not recomputed), topk experts each
        blocks = (model.replace(mtp_num_layers=0) if model.mtp_num_layers else model).num_params(include_embedding=False)
        if model.moe is not None:
            blocks -= model.moe_layer_count() * (model.moe_mlp_params(False) - model.moe_mlp_params(True))
        flops += recompute_fraction * (2.0 * blocks + attention_forward)
    return flops
