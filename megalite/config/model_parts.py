"""The parts of a RunConfig that say what is trained and how it is laid out: the model, the parallel
layout and the mixture of experts, each a frozen dataclass of settings declared with `setting(...)`
(config/setting.py). The run's other parts (training, optimizer, precision, data, checkpoint,
logging, fault tolerance) live in config/run_parts.py; `PARTS` there names all of them in order.

One field is one setting: its name (the flag is `--` + the name with dashes, Megatron-LM's
spelling), its type (the annotation), its default, its choices (an enum from config/choices.py),
its help and, for a number, the values it accepts (config/bounds.py). megalite.config assembles
the parts into RunConfig and generates the parser, the config files and validation from them.

Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.model import PRESETS
from megalite.config.setting import setting
from megalite.config.choices import (
    Recompute, Schedule, CPCommType, CPSplit, GradCompression, MoEScoreFunction, MoELoadBalancing, MoEDropPolicy,
    MoEDispatcher, Precision)


@dataclass(frozen=True)
class ModelSettings:
    """model (explicit settings override the --model preset)"""

    model: str = setting("tiny", "preset", choices=tuple(sorted(PRESETS)))
    num_layers: int | None = setting(None, "transformer blocks", minimum=1)
    hidden_size: int | None = setting(None, "model width h", minimum=1)
    num_attention_heads: int | None = setting(None, "query heads", minimum=1)
    num_query_groups: int | None = setting(None, "key/value heads (grouped-query attention)", minimum=1)
    ffn_hidden_size: int | None = setting(None, "MLP inner width", minimum=1)
    seq_length: int | None = setting(None, "sequence length (tokens per sample)", minimum=1)
    vocab_size: int | None = setting(None, "vocabulary (default: the tokenizer's)", minimum=1)
    hidden_dropout: float = setting(0.0, "dropout on the residual branches and the embedding", minimum=0, below=1)
    attention_dropout: float = setting(0.0, "dropout on the attention probabilities", minimum=0, below=1)
    window_size: int | None = setting(None, "sliding-window attention (Mistral, Qwen2): each token sees its last N "
                                            "tokens, itself included (default: the whole causal context)",
                                      minimum=1)
    # Megatron-LM's names for architecture choices (config.megatron.model_overrides; unset: the preset's)
    init_method_std: float | None = setting(None, "std of the normal weight init (output projections: std / "
                                                  "sqrt(2 * layers)); default the preset's 0.02", above=0)
    max_position_embeddings: int | None = setting(None, "Megatron's position limit: at least --seq-length (the "
                                                        "position table holds seq_length rows)", minimum=1)
    position_embedding_type: str | None = setting(None, "learned_absolute (gpt2 flavour) or rope (llama "
                                                        "flavour)", choices=("learned_absolute", "rope"))
    normalization: str | None = setting(None, "LayerNorm (gpt2 flavour) or RMSNorm (llama flavour)",
                                        choices=("LayerNorm", "RMSNorm"))
    swiglu: bool | None = setting(None, "SwiGLU MLP (llama flavour; --no-swiglu: GeLU, gpt2 flavour)")
    untie_embeddings_and_output_weights: bool | None = setting(None, "a separate output layer (default: the "
                                                                     "preset's: tied for gpt2, untied for llama)")
    disable_bias_linear: bool | None = setting(None, "no biases in the linear layers (default: the preset's)")
    group_query_attention: bool = setting(False, "Megatron's switch for --num-query-groups (which alone "
                                                 "already groups in megalite); without it: 1 group")
    norm_epsilon: float | None = setting(None, "epsilon of the layer norms (default the preset's 1e-5)", above=0)
    rotary_base: float | None = setting(None, "RoPE base theta (llama flavour; default the preset's 10000)",
                                        above=0)
    add_qkv_bias: bool | None = setting(None, "biases on the query/key/value projection alone (Qwen2; default: "
                                              "as the other linears)")
    qk_layernorm: bool | None = setting(None, "RMSNorm over each query and key head before RoPE (Qwen3; default: "
                                              "the preset's)")
    kv_channels: int | None = setting(None, "head dim d (default hidden / heads; heads * d may differ from "
                                            "hidden, as in Qwen3)", minimum=1)
    multi_latent_attention: bool = setting(False, "DeepSeek's multi-head latent attention: low-rank query and "
                                                  "key/value projections, a RoPE key shared by the heads (llama "
                                                  "flavour; docs/deepseek.md)")
    q_lora_rank: int | None = setting(None, "MLA: width of the query latent (default the preset's; none: a full "
                                            "query projection)", minimum=1)
    kv_lora_rank: int | None = setting(None, "MLA: width of the key/value latent (default 512)", minimum=1)
    qk_head_dim: int | None = setting(None, "MLA: each head's query/key channels without position (default 128)",
                                      minimum=1)
    qk_pos_emb_head_dim: int | None = setting(None, "MLA: each head's RoPE channels, the key's shared by the heads "
                                                    "(default 64)", minimum=2)
    v_head_dim: int | None = setting(None, "MLA: each head's value channels (default 128)", minimum=1)
    mtp_num_layers: int | None = setting(None, "multi-token prediction (DeepSeek-V3): D modules after the last "
                                               "block, depth k predicting k more tokens ahead (default 0: none)",
                                         metavar="D", minimum=0)
    mtp_loss_scaling_factor: float | None = setting(None, "weight lambda of the MTP losses: lambda / D times their "
                                                          "sum joins the loss (default 0.1)", minimum=0)
    make_vocab_size_divisible_by: int | None = setting(None, "pad the vocabulary to a multiple of this (times tp); "
                                                             "default 128", minimum=1)


@dataclass(frozen=True)
class ParallelSettings:
    """parallel layout and memory techniques"""

    tp: int = setting(1, "tensor-parallel size", minimum=1)
    pp: int = setting(1, "pipeline-parallel size", minimum=1)
    dp: int | None = setting(None, "data-parallel size (default: world / (tp*cp*pp))", minimum=1)
    cp: int = setting(1, "context-parallel size: each rank holds seq_length/cp tokens of every sequence (2*cp "
                         "load-balanced chunks); only attention crosses ranks", minimum=1)
    cp_comm_type: CPCommType = setting(CPCommType.P2P, "context-parallel attention: p2p (ring attention, K/V "
                                                       "round the cp ring) or a2a (Ulysses all-to-all; heads/tp "
                                                       "must divide by cp)")
    cp_split: CPSplit = setting(CPSplit.ZIGZAG, "which tokens each cp rank holds: zigzag (chunks r and 2cp-1-r of "
                                                "the sequence: even for one causal sequence) or documents (chunks r "
                                                "and 2cp-1-r of every packed document, Megatron's THD split: even "
                                                "masked work under --reset-attention-mask or --sft; no window)")
    ep: int = setting(1, "expert-parallel size: the experts of each MoE layer are sharded over ep ranks of the "
                         "dp x cp group (ep divides dp*cp); expert gradients reduce over the dp*cp/ep ranks "
                         "holding the same experts", minimum=1, synonyms=("--expert-model-parallel-size",))
    etp: int = setting(1, "expert tensor-parallel size, 1 or --tp: 1 keeps whole experts on every tp rank, each "
                          "routing its own 1/tp of the tokens (expert gradients then reduce over tp too); tp "
                          "splits every expert over tp like the dense MLP", minimum=1,
                       synonyms=("--expert-tensor-parallel-size",))
    moe_token_dispatcher_type: MoEDispatcher = setting(MoEDispatcher.ALLTOALL, "how tokens reach their experts' ep "
                                                                               "ranks: alltoall (per-rank counts) "
                                                                               "or allgather")
    virtual_stages: int = setting(1, "model chunks per pipeline rank (interleaved)", minimum=1)
    pipeline_schedule: Schedule | None = setting(None, "default: 1f1b, or interleaved when --virtual-stages > 1")
    decoder_first_stage_layers: int | None = setting(None, "blocks of the first model chunk (default: an even split)",
                                                     minimum=0)
    decoder_last_stage_layers: int | None = setting(None, "blocks of the last model chunk (default: an even split)",
                                                    minimum=0)
    pipeline_layout: str | None = setting(None, "explicit blocks per model chunk, e.g. 3,5,5,3 (pp*v numbers)")
    sequence_parallel: bool = setting(False, "shard norms, dropouts and residuals along the sequence over tp")
    zero: int = setting(0, "ZeRO stage: 1 shards the optimizer state over dp, 2 also the gradients, 3 also the "
                           "parameters (gathered unit by unit: embedding, each block, head)", choices=(0, 1, 2, 3))
    dp_shard: int | None = setting(None, "hybrid sharding: ZeRO shards over groups of S data-parallel ranks (x cp) "
                                         "and replicates across the dp/S groups: gradients reduce-scatter in a "
                                         "group, then the shard is all-reduced across the replicas (default dp: "
                                         "flat ZeRO)", metavar="S", minimum=1)
    num_distributed_optimizer_instances: int | None = setting(None, "Megatron's name for hybrid sharding: dp/S "
                                                                    "replicas of the sharded optimizer (--dp-shard "
                                                                    "dp/N)", metavar="N", minimum=1)
    zero3_prefetch: int = setting(1, "zero 3: units whose all-gather is started ahead of the running one",
                                  metavar="N", minimum=0)
    zero3_reshard_after_forward: bool = setting(True, "zero 3: free a unit's parameters after its forward and gather "
                                                      "them again for its backward (off: keep them, one gather less "
                                                      "per microbatch, more memory)")
    zero3_keep_gathered_in_step: bool = setting(False, "zero 3: gather each unit once per step and keep it until the "
                                                       "optimizer (pipelines: no re-gather per microbatch)")
    offload_optimizer: bool = setting(False, "keep the optimizer state in host memory and update there")
    overlap_param_gather: bool = setting(False, "zero >= 1: the parameter all-gathers finish behind the next "
                                                "forward; every read waits for its own bucket")
    ddp_bucket_size: int = setting(40_000_000, "elements per gradient bucket", minimum=1)
    recompute: Recompute = setting(Recompute.NONE, "activation recompute")
    recompute_num_layers: int | None = setting(None, "with --recompute full: only the first N blocks of each model "
                                                     "chunk (Megatron's block method); default all", metavar="N",
                                                     minimum=1)
    fused_linear_cross_entropy: bool = setting(False, "output layer + cross entropy in token chunks: the logits "
                                                      "[tokens, vocab/tp] are never held (one more output GEMM)")
    grad_compression: GradCompression = setting(GradCompression.NONE, "compress the dp gradient reduction: powersgd "
                                                                      "sends rank-R factors of each matrix (error "
                                                                      "feedback keeps what they miss for the next "
                                                                      "step); zero 0-2")
    powersgd_rank: int = setting(4, "PowerSGD: rank R of the factors (R*(n+m) elements per n x m matrix instead of "
                                    "n*m)", metavar="R", minimum=1, fix="4 is a good start")
    powersgd_warmup_steps: int = setting(0, "PowerSGD: the first N steps reduce uncompressed", metavar="N",
                                         minimum=0)
    powersgd_min_compression: float = setting(2.0, "PowerSGD: matrices that would not shrink by at least this "
                                                   "factor (and every 1-D parameter) are reduced uncompressed",
                                              minimum=0, fix="0 compresses every matrix; 2 is the default")
    diloco_inner_steps: int = setting(0, "DiLoCo across the replica groups of --dp-shard: each group trains H steps "
                                         "on its own (no replica all-reduce), then one outer step on the "
                                         "pseudo-gradients (0: off)", metavar="H", minimum=0)
    diloco_outer_lr: float = setting(0.7, "DiLoCo: the outer SGD's learning rate (1 with no momentum: the groups' "
                                          "mean)", minimum=0)
    diloco_outer_momentum: float = setting(0.9, "DiLoCo: the outer SGD's Nesterov momentum", minimum=0, below=1)
    diloco_fragments: int = setting(1, "streaming DiLoCo: F fragments of contiguous layers, each synced every H "
                                       "steps at staggered steps (one every H/F), so a sync carries ~1/F of the "
                                       "parameters; F divides H (1: every parameter at once)", metavar="F",
                                    minimum=1)
    diloco_reduce_dtype: Precision = setting(Precision.FP32, "DiLoCo: the dtype its outer all-reduce crosses the "
                                                             "replica links in: fp32 averages the parameters, bf16 "
                                                             "the pseudo-gradients (θ_outer - θ, half the bytes)")


@dataclass(frozen=True)
class MoESettings:
    """mixture of experts (Megatron's flags; unset: the --model preset's, else megalite.config.moe.MoEConfig's default)"""

    num_experts: int | None = setting(None, "routed experts per MoE layer (turns the model's MLPs into mixtures of "
                                            "experts)", minimum=1)
    moe_router_topk: int | None = setting(None, "experts per token (default 2)", minimum=1)
    moe_ffn_hidden_size: int | None = setting(None, "each expert's inner width (default: --ffn-hidden-size)", minimum=1)
    moe_layer_freq: tuple[int, ...] | None = setting(None, "one number N: every N-th block (from block 0) is an MoE "
                                                         "block (default 1: all); several: one 0 (dense) or 1 (MoE) "
                                                         "per block, e.g. 0 0 1 1 (DeepSeek's first dense blocks)",
                                                   metavar="N", minimum=0)
    moe_router_score_function: MoEScoreFunction | None = setting(None, "router scores (default softmax)")
    moe_router_pre_softmax: bool | None = setting(None, "softmax over all experts before the top-k (default off: a "
                                                        "softmax over the k chosen logits, Mixtral's renormalised "
                                                        "weights)")
    moe_router_load_balancing_type: MoELoadBalancing | None = setting(None, "balancing loss: over the layer's tokens "
                                                                            "(aux_loss, default), per sequence, or "
                                                                            "none")
    moe_aux_loss_coeff: float | None = setting(None, "weight of the load-balancing loss (default 0)", minimum=0)
    moe_z_loss_coeff: float | None = setting(None, "weight of the router z-loss (default 0)", minimum=0)
    moe_router_enable_expert_bias: bool | None = setting(None, "DeepSeek-V3 auxiliary-loss-free balancing: a "
                                                               "per-expert score bias for the choice, stepped toward "
                                                               "the mean load after each step")
    moe_router_bias_update_rate: float | None = setting(None, "step of the expert bias (default 1e-3)", minimum=0)
    moe_router_num_groups: int | None = setting(None, "group-limited routing (DeepSeek-V2/V3's n_group): the experts "
                                                      "in this many groups; a token picks --moe-router-group-topk "
                                                      "groups first, then its experts in them", minimum=1)
    moe_router_group_topk: int | None = setting(None, "groups a token may route to (DeepSeek's topk_group)", minimum=1)
    moe_router_topk_scaling_factor: float | None = setting(None, "multiply the routing weights by this (DeepSeek's "
                                                                 "routed_scaling_factor; default 1)", above=0)
    moe_shared_expert_intermediate_size: int | None = setting(None, "inner width of an always-active shared expert "
                                                                    "(default none)", minimum=1)
    moe_expert_capacity_factor: float | None = setting(None, "cap each expert at factor * tokens * topk / experts "
                                                             "routes per rank and layer (default: dropless)", above=0)
    moe_token_drop_policy: MoEDropPolicy | None = setting(None, "over capacity keep the highest-probability routes "
                                                                "(probs, default) or the earliest tokens (position)")
    moe_router_force_load_balancing: bool | None = setting(None, "benchmarking and testing only: route every rank's "
                                                                 "tokens exactly balanced over the experts (the "
                                                                 "planner's routing), whatever the scores choose")
