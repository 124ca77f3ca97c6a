"""The parts of a RunConfig, each a frozen dataclass of settings declared with `setting(...)`.

One field is one setting: its name (the flag is `--` + the name with dashes, Megatron-LM's
spelling), its type (the annotation), its default, its choices (an enum from config/choices.py),
its help and, for a number, the values it accepts (config/bounds.py). megalite.config assembles
the parts into RunConfig and generates the parser, the config files and validation from them.

Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megalite.config.model import PRESETS
from megalite.config.bounds import Bounds
from megalite.config.choices import (
    Precision, Recompute, Schedule, LRDecay, LRWSDDecay, ElasticBatch, ElasticLRRule, OnNonFinite, CPCommType,
    GradCompression,
    MoEScoreFunction, MoELoadBalancing, MoEDropPolicy, MoEDispatcher, Fp8Format, Fp8ScalingRecipe, Fp8Scales,
    SFTOverlong, OptimizerKind, MuonAdjustLR, MuonOwners)


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the largest loss scale the loss's dtype holds


def setting(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
            aliases: dict[str, Any] | None = None, synonyms: tuple[str, ...] = (), **bounds: Any) -> Any:
    """Declare one setting. `choices` for plain types (enums carry their own); `aliases` are
    extra flags that set a value (e.g. Megatron's --bf16 for precision = bf16); `synonyms` are other
    names of the flag itself, taking the same value (Megatron's --expert-model-parallel-size for
    --ep), also accepted as config-file keys; `bounds`, for
    numbers, the values it accepts (config.bounds.Bounds: minimum, maximum, above, below, finite,
    at_most=another setting, fix=advice), checked by `bound_problems` before anything uses them."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "aliases": aliases or {}, "synonyms": tuple(synonyms),
                                            "bounds": Bounds(**bounds)})


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


@dataclass(frozen=True)
class MoESettings:
    """mixture of experts (Megatron's flags; unset: the --model preset's, else megalite.moe.config.MoEConfig's default)"""

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


@dataclass(frozen=True)
class TrainingSettings:
    """training"""

    train_iters: int = setting(600, "optimizer steps", minimum=1)
    micro_batch_size: int = setting(8, "sequences per microbatch and dp rank", minimum=1)
    global_batch_size: int | None = setting(None, "sequences per optimizer step (default: micro-batch-size * dp)",
                                                  minimum=1)
    rampup_batch_size: tuple[int, int, int] | None = setting(None, "Megatron's batch-size ramp-up: the global batch "
                                                                   "starts at START and grows by INCREMENT in equal "
                                                                   "shares of the first SAMPLES samples up to "
                                                                   "--global-batch-size (config/rampup.py)",
                                                             metavar=("START", "INCREMENT", "SAMPLES"), minimum=1)
    seed: int = setting(1234, "seed of the weights, the data order and dropout", minimum=0, maximum=2**32 - 1)
    eval_interval: int = setting(0, "evaluate every N steps (0: only at the end)", minimum=0)
    eval_iters: int = setting(4, "global batches per evaluation", minimum=0)
    compile: bool = setting(False, "torch.compile each transformer block in place (torchtitan's --compile; the "
                                   "parameters and checkpoints unchanged; the first steps pay the compilation; on a "
                                   "CPU it needs a C compiler): megalite/training/compile.py")
    cuda_graph: bool = setting(False, "capture each microbatch's forward and backward once as a CUDA graph and "
                                      "replay it (per pipeline chunk at pp > 1; static shapes; tp = cp = ep "
                                      "= 1, zero 0/1, no dropout, recompute, offload or MoE; "
                                      "training/cuda_graph.py, pipeline_graphs.py)")
    exit_interval: int | None = setting(None, "save (with --save) and stop after every step that is a multiple of N "
                                              "(Megatron's --exit-interval)", minimum=1)
    exit_duration_in_mins: float | None = setting(None, "save (with --save) and stop after the first step that ends "
                                                        "M minutes after the run started (every rank agrees on the "
                                                        "step)", above=0)


@dataclass(frozen=True)
class OptimizerSettings:
    """optimizer (AdamW) and learning-rate schedule"""

    lr: float = setting(2e-3, "peak learning rate", minimum=0)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", minimum=0, at_most="lr")
    lr_warmup_iters: int = setting(30, "linear warm-up steps (unless --lr-warmup-fraction)", minimum=0)
    lr_warmup_fraction: float | None = setting(None, "warm-up as a fraction of the decay steps (Megatron's rule; "
                                                     "overrides --lr-warmup-iters)", minimum=0, maximum=1)
    lr_decay_iters: int | None = setting(None, "steps over which the learning rate decays to --min-lr (default "
                                               "--train-iters); constant at --min-lr after", minimum=1)
    lr_decay_style: LRDecay = setting(LRDecay.COSINE, "decay after warm-up")
    lr_wsd_decay_style: LRWSDDecay = setting(LRWSDDecay.EXPONENTIAL, "--lr-decay-style WSD: how the last "
                                                                      "--lr-wsd-decay-iters steps anneal to --min-lr")
    lr_wsd_decay_iters: int | None = setting(None, "--lr-decay-style WSD: the final steps of the decay that anneal "
                                                   "(before them the peak --lr holds)", minimum=1)
    weight_decay: float = setting(0.1, "decoupled weight decay (not on biases and norms)", minimum=0)
    adam_beta1: float = setting(0.9, "AdamW beta1", minimum=0, below=1)
    adam_beta2: float = setting(0.95, "AdamW beta2", minimum=0, below=1)
    adam_eps: float = setting(1e-8, "AdamW epsilon", above=0)
    clip_grad: float = setting(1.0, "global grad-norm clip; 0 disables", minimum=0)
    # Muon (megalite/optim/muon.py, docs/muon.md): the hidden matrices; AdamW above on everything else
    optimizer: OptimizerKind = setting(OptimizerKind.ADAMW, "adamw everywhere, or muon on the transformer blocks' "
                                                            "2-D weights with AdamW on the rest")
    muon_lr: float | None = setting(None, "--optimizer muon: the Muon group's peak lr (default --lr; the schedule "
                                          "scales it in proportion)", minimum=0)
    muon_momentum: float = setting(0.95, "--optimizer muon: momentum (Nesterov)", minimum=0, below=1)
    muon_nesterov: bool = setting(True, "--optimizer muon: Nesterov momentum (--no-muon-nesterov: plain)")
    muon_ns_steps: int = setting(5, "--optimizer muon: Newton-Schulz iterations", minimum=1, maximum=99)
    muon_ns_coefficients: tuple[float, float, float] = setting((3.4445, -4.7750, 2.0315),
                                                               "--optimizer muon: the quintic's a b c", minimum=-100, maximum=100)
    muon_adjust_lr: MuonAdjustLR = setting(MuonAdjustLR.MATCH_RMS_ADAMW, "--optimizer muon: update scale of an "
                                                                          "[A, B] matrix: 0.2*sqrt(max(A, B)) "
                                                                          "(AdamW's lr carries over) or "
                                                                          "sqrt(max(1, A/B))")
    muon_ns_dtype: str = setting("bf16", "--optimizer muon: Newton-Schulz in bf16 (torch's, the recipes') or fp32 "
                                         "(slower; what the layout tests compare)", choices=("bf16", "fp32"))
    muon_owners: MuonOwners = setting(MuonOwners.BALANCED, "--optimizer muon: which rank orthogonalises which "
                                                           "matrix (balanced: the FLOPs spread)")


@dataclass(frozen=True)
class PrecisionSettings:
    """precision"""

    precision: Precision = setting(Precision.FP32, "parameter and activation dtype (bf16/fp16 keep fp32 master "
                                                   "weights and gradients)",
                                   aliases={"--bf16": Precision.BF16, "--fp16": Precision.FP16})
    grad_reduce_dtype: Precision = setting(Precision.FP32, "dtype of the data-parallel gradient reduction")
    initial_loss_scale: float = setting(2.0 ** 16, "fp16: first loss scale", above=0, maximum=FLOAT32_MAX,
                                        fix="the loss is scaled in float32: e.g. --initial-loss-scale 65536 (the "
                                            "default; Megatron's is 4294967296)")
    loss_scale_window: int = setting(1000, "fp16: steps without overflow to grow", minimum=1)
    hysteresis: int = setting(2, "fp16: overflows tolerated before the scale backs off", minimum=1)
    loss_scale_backoff: float = setting(0.5, "fp16: factor applied on backoff", above=0, below=1)
    fp8_format: Fp8Format | None = setting(None, "FP8 GEMMs in every transformer-block linear and expert (off by "
                                                 "default): e4m3, or hybrid (e5m2 gradients); docs/fp8.md")
    fp8_recipe: Fp8ScalingRecipe = setting(Fp8ScalingRecipe.TENSORWISE, "with --fp8-format: one scale per tensor "
                                                                         "(tensorwise), per row (rowwise), or per "
                                                                         "1x128 / 128x128 tile (blockwise)")
    fp8_scales: Fp8Scales = setting(Fp8Scales.POW2, "with --fp8-format: scales rounded down to a power of two "
                                                    "(pow2) or fp8 max / amax as it comes (exact); docs/fp8.md")
    fp8_param_gather: bool = setting(False, "with --fp8-format and --zero 3: all-gather the FP8 layers' weights in "
                                            "FP8 (1 byte per element on the wire); tensorwise only")


@dataclass(frozen=True)
class DataSettings:
    """data"""

    data_path: tuple[str, ...] | None = setting(None, "PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend (default: "
                                                      "the embedded corpus)")
    tokenizer: str | None = setting(None, "a tokenizer.json, a tokenizer directory or a SentencePiece .model (default: "
                                           "byte level; Megatron's --tokenizer-type flags: docs/megatron.md)")
    mock_data: bool = setting(False, "synthetic token ids over the model's vocabulary (deterministic per seed and "
                                     "sample), no corpus: for speed and memory runs of a real-vocabulary model")
    split: str = setting("969,30,1", "train,valid,test weights of the documents")
    sft: bool = setting(False, "--data-path holds SFT samples (tools/preprocess_data.py --sft: tokens and a loss "
                               "mask): sequences of whole samples, position ids restarting per sample, labels "
                               "-100 on prompt tokens and padding (megalite/data/sft_dataset.py)")
    sft_packing: bool = setting(True, "with --sft: pack several samples into each sequence (in a seeded order, "
                                      "none cut); --no-sft-packing: one sample per sequence, padded")
    sft_overlong: SFTOverlong = setting(SFTOverlong.REFUSE, "with --sft: a sample longer than --seq-length is "
                                                            "refused, naming it, or truncated to fit")
    # Megatron's document flags (data/documents.py, docs/documents.md): from the end-of-document token
    reset_position_ids: bool = setting(False, "positions restart at 0 after each end-of-document token (with "
                                              "--reset-attention-mask)")
    reset_attention_mask: bool = setting(False, "no token attends to another document of its sample (with "
                                                "--reset-position-ids: the documents are read from the positions)")
    eod_mask_loss: bool = setting(False, "no loss on the end-of-document tokens' targets")
    mean_document_length: float | None = setting(None, "with --reset-attention-mask: the planner's and "
                                                       "--simulate's mean tokens per document (attention FLOPs "
                                                       "and time; training counts its real documents)", above=0)


@dataclass(frozen=True)
class CheckpointSettings:
    """checkpoints (layout-free: save at one tp/pp/dp, load at any other)"""

    save: str | None = setting(None, "write checkpoints into DIR", metavar="DIR")
    load: str | None = setting(None, "resume from DIR's latest checkpoint (from scratch, with a notice, when it "
                                     "holds none); pass the same DIR as --save so one command line serves every "
                                     "restart", metavar="DIR")
    load_step: int | None = setting(None, "load this step instead of the latest", minimum=0)
    save_interval: int = setting(0, "save every N steps (0: only at the end/on signal)", minimum=0)
    keep_last: int = setting(0, "keep the newest N checkpoints (0: keep all)", minimum=0)
    keep_every: int = setting(0, "also keep every step that is a multiple of M", minimum=0)
    async_save: bool = setting(False, "copy to CPU memory, write in a background thread")
    no_load_optim: bool = setting(False, "load weights only (fresh optimizer, step 0)")
    finetune: bool = setting(False, "start a fine-tune from --load's checkpoint (or HF import): its weights and "
                                    "model only; a fresh optimizer, step 0, the data from its start, fresh RNG "
                                    "(a restart resumes from --save once that holds a checkpoint)")
    overwrite_checkpoints: bool = setting(False, "write into a --save directory although it holds checkpoints this "
                                                 "run does not resume (a fresh run, another --load, or an older "
                                                 "--load-step): they are replaced or pruned")
    elastic_batch: ElasticBatch = setting(ElasticBatch.KEEP, "resuming on another world (dp re-derived, tp/pp "
                                                             "kept): keep the checkpoint's global batch (more or "
                                                             "fewer accumulation steps; the loss curve continues), "
                                                             "or scale it with dp and rescale the learning rate")
    elastic_lr_rule: ElasticLRRule = setting(ElasticLRRule.LINEAR, "with --elastic-batch scale: the learning rate "
                                                                   "times the batch ratio r (linear) or sqrt(r)")
    override_data_order: bool = setting(False, "resume although --seed, --data-path, --split, --tokenizer or "
                                               "--seq-length differ from the checkpoint's run (the samples read "
                                               "from here on are not the ones it would have read)")
    override_opt_param_scheduler: bool = setting(False, "resume although --lr, --min-lr, --lr-warmup-iters, "
                                                        "--lr-decay-style or --train-iters differ from the "
                                                        "checkpoint's run (the learning-rate schedule changes)")


@dataclass(frozen=True)
class LoggingSettings:
    """logging, metrics and profiling"""

    log_interval: int = setting(50, "print and record every N steps", minimum=1)
    metrics_file: str | None = setting(None, "JSON lines, one object per logged step (the resolved configuration "
                                             "is written beside it)")
    tensorboard_dir: str | None = setting(None, "also write the metrics as TensorBoard scalars into DIR (pip install "
                                                "'megalite[tensorboard]')", metavar="DIR")
    wandb_project: str | None = setting(None, "also log the metrics to this Weights & Biases project (pip install "
                                              "'megalite[wandb]'; WANDB_MODE=offline logs locally)")
    wandb_exp_name: str | None = setting(None, "the W&B run's name (default: W&B's)")
    wandb_save_dir: str | None = setting(None, "where W&B keeps its files (default: ./wandb)", metavar="DIR")
    straggler_interval: int = setting(0, "every N steps name the slowest ranks (0: off)", minimum=0)
    peak_tflops: float | None = setting(None, "per-GPU peak for MFU (default: known GPUs)", above=0)
    profile_steps: tuple[int, int] | None = setting(None, "trace steps FIRST..LAST with torch.profiler on every rank "
                                                          "(Chrome trace per rank)", metavar=("FIRST", "LAST"),
                                                          minimum=1)
    profile_dir: str = setting("profile", "where --profile-steps writes its traces")
    memory_snapshot: str | None = setting(None, "on CUDA: record the allocator's history and write each rank's "
                                                "snapshot into DIR after --memory-snapshot-step, or when the run "
                                                "ends before it (an out-of-memory error); open it at "
                                                "pytorch.org/memory_viz", metavar="DIR")
    memory_snapshot_step: int = setting(2, "with --memory-snapshot: the step after which the snapshot is written",
                                        minimum=1)


@dataclass(frozen=True)
class FaultToleranceSettings:
    """hangs and numerical guards"""

    hang_timeout: float = setting(0.0, "seconds without a finished step before every rank reports where it waits "
                                       "and the job exits with code 86 (0: off; e.g. 300)", minimum=0,
                                       fix="0 turns the watchdog off; e.g. 300")
    hang_report_dir: str | None = setting(None, "where ranks leave hang reports (default: a temp dir per node; a "
                                                "shared file system gives one summary across nodes)")
    on_nonfinite: OnNonFinite = setting(OnNonFinite.SKIP, "a non-finite loss or gradient: skip the update and log "
                                                          "the step's samples, or stop (exit code 3)")
    max_skipped_steps: int = setting(50, "stop (exit code 3) after N steps in a row whose update was skipped (a "
                                         "non-finite loss or gradient, an fp16 overflow): a run that trains nothing "
                                         "must not end as if it had; 0: never", minimum=0)
    check_replicas_interval: int = setting(0, "every K steps compare parameter checksums across replicas and stop "
                                              "(exit code 4) naming the first that differs; 0: off", minimum=0)


PARTS: dict[str, type] = {
    "model": ModelSettings, "parallel": ParallelSettings, "moe": MoESettings, "training": TrainingSettings,
    "optimizer": OptimizerSettings, "precision": PrecisionSettings, "data": DataSettings,
    "checkpoint": CheckpointSettings, "logging": LoggingSettings, "fault_tolerance": FaultToleranceSettings,
}
