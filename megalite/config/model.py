"""GPT model configuration: one dataclass for both flavours, presets, and layout checks.

Flavours:
- "gpt2":  LayerNorm, tanh-GeLU MLP, learned positions, biases, tied input/output embeddings.
- "llama": RMSNorm, SwiGLU MLP, rotary positions (rotate-half), grouped-query attention,
           no biases, untied output layer.

Either flavour may replace its MLPs by mixtures of experts (`moe`, a `megalite.config.moe.MoEConfig`):
SwiGLU experts for llama, GeLU experts for gpt2 (experts carry no biases).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.config.mla import MLAConfig
from megalite.config.rope_scaling import check_rope_scaling
from megalite.config.moe import MoEConfig


def attention_span(seq_length: float, mean_document_length: float | None = None, window: int | None = None) -> float:
    """The keys per query that attention's FLOP term counts, in PaLM's convention (a causal sequence of s
    tokens counts s): 2 * (pairs a query block computes per token) - 1, over documents of
    `mean_document_length` tokens (None: one document of seq_length) and a sliding `window` (None: none).
    A document of n tokens computes sum_i min(i + 1, window) pairs; without a window n (n + 1) / 2, so the
    span is n: the work Σ len^2 / s per token that the kernels do (docs/documents.md)."""
    n = min(float(mean_document_length or seq_length), float(seq_length))
    if window is None or window >= n:
        pairs = n * (n + 1) / 2
    else:
        pairs = window * (window + 1) / 2 + (n - window) * window
    return 2 * pairs / n - 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class GPTConfig:
    flavour: str = "gpt2"
    """"gpt2" or "llama"."""
    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 128
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads; must divide by tp."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (None: one per query head, i.e. MHA)."""
    ffn_hidden_size: int | None = None
    """MLP inner width (None: 4h for gpt2, the Llama 8h/3 rounded to 256 for llama)."""
    vocab_size: int = 257
    """True vocabulary size; the embedding is padded (never refused) to a multiple of
    make_vocab_size_divisible_by * tp, and padded columns never enter the loss."""
    seq_length: int = 128
    """Maximum sequence length (learned position table size for gpt2)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * num_layers)."""
    tie_embeddings: bool | None = None
    """None: tied for gpt2, untied for llama."""
    add_bias: bool | None = None
    """None: biases for gpt2, none for llama. The default of the three per-layer bias switches below."""
    qkv_bias: bool | None = None
    """Biases on the query/key/value projection (None: add_bias; Qwen2/2.5 set it alone)."""
    proj_bias: bool | None = None
    """Bias on the attention output projection (None: add_bias)."""
    mlp_bias: bool | None = None
    """Biases on the dense MLP's linears (None: add_bias; experts never carry biases)."""
    kv_channels: int | None = None
    """Head dim d (None: hidden_size / num_attention_heads). Qwen3 sets heads * d != hidden_size."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head (weights [d], shared by the heads) before RoPE (Qwen3)."""
    rope_scaling: dict | None = None
    """None: plain RoPE. {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}: Llama 3.1's frequency scaling (config/rope_scaling.py)."""
    make_vocab_size_divisible_by: int = 128
    moe: MoEConfig | None = None
    """Mixture of experts (a MoEConfig, or its keywords as a dict); None: dense MLPs."""
    mtp_num_layers: int = 0
    """Multi-token prediction (DeepSeek-V3): D sequential modules after the last block, depth k predicting the
    token k+1 ahead of the next one, sharing the embedding and the output layer (model/mtp.py)."""
    mtp_loss_scaling_factor: float = 0.1
    """lambda: the MTP losses add lambda / D times their sum to the training loss."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (DeepSeek-V2/V3: an MLAConfig, or its keywords as a dict; llama flavour);
    None: the fused-QKV attention. num_query_groups is then the number of heads (each has its own key)."""
    window_size: int | None = None
    """Sliding-window attention (Mistral, Qwen2): each query sees its last window_size keys, itself
    included; None: the whole causal context (kernels/attention_documents.py)."""

    def __post_init__(self):
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if self.flavour not in ("gpt2", "llama"):
            raise ValueError(f"flavour must be 'gpt2' or 'llama', got {self.flavour!r}")
        if self.num_query_groups is None or self.mla is not None:
            self.num_query_groups = self.num_attention_heads
        if self.mtp_num_layers < 0 or self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"--mtp-num-layers {self.mtp_num_layers} and --mtp-loss-scaling-factor "
                             f"{self.mtp_loss_scaling_factor} must be >= 0")
        if self.mla is not None:
            problems = self.mla.problems(self.hidden_size) + (
                [] if self.flavour == "llama" else ["--multi-latent-attention needs the llama flavour (RMSNorm, "
                                                    "SwiGLU, RoPE)"])
            if problems:
                raise ValueError("; ".join(problems))
        if self.ffn_hidden_size is None:
            if self.flavour == "gpt2":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 256 * ((int(8 * self.hidden_size / 3) + 255) // 256)
        if self.tie_embeddings is None:
            self.tie_embeddings = self.flavour == "gpt2"
        if self.add_bias is None:
            self.add_bias = self.flavour == "gpt2"
        for name in ("qkv_bias", "proj_bias", "mlp_bias"):
            if getattr(self, name) is None:
                setattr(self, name, self.add_bias)
        if self.moe is not None and isinstance(self.moe.layer_freq, tuple) \
                and len(self.moe.layer_freq) != self.num_layers:
            raise ValueError(f"--moe-layer-freq lists {len(self.moe.layer_freq)} blocks but the model has "
                             f"{self.num_layers}; give one 0 or 1 per block")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)  # one line naming what is unsupported
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"num_query_groups={self.num_query_groups}")
        if self.window_size is not None and self.window_size < 1:
            raise ValueError(f"window_size={self.window_size}: a sliding window holds at least the query itself; "
                             f"give --window-size >= 1, or none for full causal attention")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rope_head_dim(self) -> int:
        """The channels RoPE rotates per head: all of them, or MLA's decoupled position part."""
        return self.head_dim if self.mla is None else self.mla.qk_pos_emb_head_dim

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's padding: the next multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ((self.vocab_size + multiple - 1) // multiple) * multiple

    def replace(self, **changes) -> "GPTConfig":
        if "add_bias" in changes:  # the per-kind switches follow a new add_bias unless given too
            changes = {**{name: None for name in ("qkv_bias", "proj_bias", "mlp_bias")}, **changes}
        return dataclasses.replace(self, **changes)

    # --- counts ---------------------------------------------------------------------------

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameters of the unpadded model (each tied tensor once)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv_out = (self.num_attention_heads + 2 * self.num_query_groups) * d
        norm = 2 * h if self.flavour == "gpt2" else h
        per_layer = h * qkv_out + self.num_attention_heads * d * h + 2 * norm + 2 * d * self.qk_layernorm
        if self.mla is not None:  # latent attention instead of the fused QKV (no biases)
            per_layer = self.mla.params(h, self.num_attention_heads) + 2 * norm
        dense_mlp = (h * f + f * h) if self.flavour == "gpt2" else 3 * h * f
        per_layer += dense_mlp
        mlp_biases = ((f if self.flavour == "gpt2" else 2 * f) + h) * self.mlp_bias
        per_layer += (qkv_out * self.qkv_bias + h * self.proj_bias) * (self.mla is None) + mlp_biases
        total = self.num_layers * per_layer + norm  # + final norm
        moe_change = self.moe_mlp_params(active=False) - dense_mlp - mlp_biases if self.moe is not None else 0
        total += self.moe_layer_count() * moe_change
        for k in range(self.mtp_num_layers):  # DeepSeek's MTP depths: a block, three norms, M_k [h, 2h]
            total += per_layer + 3 * norm + 2 * h * h + moe_change * self.is_moe_block(self.num_layers + k)
        if include_embedding:
            total += self.vocab_size * h
            if not self.tie_embeddings:
                total += self.vocab_size * h
            if self.flavour == "gpt2":
                total += self.seq_length * h
        return total

    def is_moe_block(self, layer_id: int) -> bool:
        """Block `layer_id` (an MTP depth's past num_layers) has experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer_id)

    def moe_layer_count(self) -> int:
        """Blocks whose MLP is a mixture of experts."""
        return 0 if self.moe is None else sum(self.moe.is_moe_layer(i) for i in range(self.num_layers))

    def moe_mlp_params(self, active: bool) -> int:
        """Parameters of one MoE layer's MLP part (router, experts, shared expert); `active`: only the
        topk experts a token uses (what its FLOPs see)."""
        moe, h = self.moe, self.hidden_size
        per_expert = (2 if self.flavour == "gpt2" else 3) * h * moe.expert_ffn(self.ffn_hidden_size)
        shared = moe.shared_expert_intermediate_size or 0
        shared_params = (2 if self.flavour == "gpt2" else 3) * h * shared + h * moe.shared_expert_gate
        return moe.num_experts * h + (moe.topk if active else moe.num_experts) * per_expert + shared_params

    def flops_per_token(self, seq_length: int | None = None, mean_document_length: float | None = None, *,
                        span: float | None = None) -> float:
        """Training FLOPs per token: 6N (dense matmuls, forward + backward) + 12*L*h*s (attention), s the
        attention span over packed documents of `mean_document_length` and the window (`attention_span`),
        or `span` as measured on a step's documents. With experts N counts the topk experts a token passes
        through, not all of them. DeepSeek's MTP depths (on every token) each add a block, M_k and one more
        pass through the shared output layer."""
        s = span if span is not None else attention_span(seq_length or self.seq_length, mean_document_length,
                                                          self.window_size)
        heads = 1 + self.mtp_num_layers  # the output layer: the model's, then each depth's
        n_matmul = self.num_params(include_embedding=False) + heads * self.vocab_size * self.hidden_size
        if self.moe is not None:
            moe_blocks = self.moe_layer_count() + sum(self.is_moe_block(self.num_layers + k)
                                                      for k in range(self.mtp_num_layers))
            n_matmul -= moe_blocks * (self.moe_mlp_params(False) - self.moe_mlp_params(True))
        return 6.0 * n_matmul + 6.0 * (self.num_layers + self.mtp_num_layers) * self.scores_width() * s

    def scores_width(self) -> int:
        """The q.k and p.v channels per token over all heads: 2h (d * heads = h), n (d_qk + d_v) under MLA."""
        if self.mla is not None:
            return self.num_attention_heads * (self.mla.qk_dim + self.mla.v_head_dim)
        return 2 * self.hidden_size

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError, naming valid choices, when the model cannot be split tp ways."""
        checks = (("num_attention_heads", self.num_attention_heads),
                  ("num_query_groups", self.num_query_groups),
                  ("ffn_hidden_size", self.ffn_hidden_size))
        for name, value in checks:
            if value % tp != 0:
                valid = [d for d in _divisors(self.num_attention_heads)
                         if self.num_query_groups % d == 0 and self.ffn_hidden_size % d == 0]
                raise ValueError(f"{name}={value} is not divisible by tp={tp}; choose tp in {valid}")
        if self.moe is not None:  # experts are tensor-parallel like the dense MLP (along their inner width)
            for name, value in (("--moe-ffn-hidden-size", self.moe.expert_ffn(self.ffn_hidden_size)),
                                ("--moe-shared-expert-intermediate-size",
                                 self.moe.shared_expert_intermediate_size or 0)):
                if value % tp != 0:
                    raise ValueError(f"{name} {value} is not divisible by tp={tp}; choose a multiple of {tp}")


_LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)



def _yarn(factor: float, mscale: float) -> dict:
    """DeepSeek's YaRN over its 4k pretraining context (mscale = mscale_all_dim, as its configs have it)."""
    return dict(rope_type="yarn", factor=factor, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                mscale=mscale, mscale_all_dim=mscale)


_DEEPSEEK_MLA = dict(kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
# sigmoid scores with the correction bias (bias speed 1e-3) and the small sequence-wise loss (alpha 1e-4)
_DEEPSEEK_ROUTER = dict(score_function="sigmoid", enable_expert_bias=True, load_balancing_type="seq_aux_loss",
                        aux_loss_coeff=1e-4)

# Presets are keyword sets, so an override (say hidden_size) re-derives what depends on it.
PRESETS: dict[str, dict] = {
    "tiny": dict(flavour="gpt2", num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=257,
                 seq_length=128),
    "tiny-llama": dict(flavour="llama", num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=352, vocab_size=257, seq_length=128, norm_eps=1e-6),
    "gpt2-124m": dict(flavour="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                      seq_length=1024),
    "gpt2-350m": dict(flavour="gpt2", num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50257,
                      seq_length=1024),
    "gpt2-1.3b": dict(flavour="gpt2", num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257,
                      seq_length=2048),
    "llama-1b": dict(flavour="llama", num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                     ffn_hidden_size=5632, vocab_size=32000, seq_length=2048),
    # Llama-3.2-1B's shape, with its llama3 RoPE frequency scaling (factor 32): real 128k vocabulary,
    # tied embeddings; train it on --mock-data without a corpus of that tokenizer
    "llama3-1b": dict(flavour="llama", num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=8192, vocab_size=128256, seq_length=2048, rope_theta=500000.0,
                      tie_embeddings=True, rope_scaling={**_LLAMA31_SCALING, "factor": 32.0}),
    "llama-7b": dict(flavour="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                     ffn_hidden_size=11008, vocab_size=32000, seq_length=4096),
    "llama-13b": dict(flavour="llama", num_layers=40, hidden_size=5120, num_attention_heads=40,
                      ffn_hidden_size=13824, vocab_size=32000, seq_length=4096),
    # tiny-llama's width with 4 experts (top 2: its active FFN width) at half its depth and sequence: the
    # default 600 steps train on a 2-core CPU in under a minute (a CPU step is its GEMMs' FLOPs; see
    # docs/benchmarks.md, "moe-tiny on a CPU")
    "moe-tiny": dict(flavour="llama", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=352, vocab_size=257, seq_length=64, norm_eps=1e-6,
                     moe=dict(num_experts=4, topk=2, ffn_hidden_size=176, aux_loss_coeff=1e-2)),
    "mixtral-8x7b": dict(flavour="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, rope_theta=1e6,
                         moe=dict(num_experts=8, topk=2, aux_loss_coeff=0.02)),
    "llama-70b": dict(flavour="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                      ffn_hidden_size=28672, vocab_size=32000, seq_length=4096),
    # Today's families at their published shapes (HF config.json); seq_length is a training length.
    # Llama 3.1 (8B, 70B) and 3.2 (3B, tied embeddings) with their llama3 rope scaling.
    "llama3-8b": dict(flavour="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, rope_theta=500000.0,
                      rope_scaling=_LLAMA31_SCALING),
    "llama3-70b": dict(flavour="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, rope_theta=500000.0,
                       rope_scaling=_LLAMA31_SCALING),
    "llama3.2-3b": dict(flavour="llama", num_layers=28, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
                        ffn_hidden_size=8192, vocab_size=128256, seq_length=8192, rope_theta=500000.0,
                        tie_embeddings=True, rope_scaling={**_LLAMA31_SCALING, "factor": 32.0}),
    "mistral-7b": dict(flavour="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=14336, vocab_size=32768, seq_length=4096, rope_theta=1e6),  # v0.3
    "qwen2.5-7b": dict(flavour="llama", num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                       ffn_hidden_size=18944, vocab_size=152064, seq_length=4096, rope_theta=1e6, norm_eps=1e-6,
                       qkv_bias=True),
    "qwen3-8b": dict(flavour="llama", num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                     ffn_hidden_size=12288, vocab_size=151936, seq_length=4096, rope_theta=1e6, norm_eps=1e-6,
                     qk_layernorm=True),
    "qwen3-30b-a3b": dict(flavour="llama", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                          kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, seq_length=4096, rope_theta=1e6,
                          norm_eps=1e-6, qk_layernorm=True,
                          moe=dict(num_experts=128, topk=8, ffn_hidden_size=768, aux_loss_coeff=1e-3)),
    # Llama 3.1 405B's shape (Meta's model card): the 16,384-rank simulation's model (docs/simulate.md)
    "llama-405b": dict(flavour="llama", num_layers=126, hidden_size=16384, num_attention_heads=128,
                       num_query_groups=8, ffn_hidden_size=53248, vocab_size=128256, seq_length=8192,
                       rope_theta=5e5, rope_scaling=_LLAMA31_SCALING),
    # DeepSeek's family (HF config.json; megalite/model/hf_deepseek.py): latent attention, group-limited sigmoid
    # routing with the correction bias, shared experts, dense first blocks. V3's 671B (37B active) without its
    # MTP module; V2-Lite (15.7B, no query latent, softmax experts); Moonlight (16B, 3B active: V3's design)
    "deepseek-v3": dict(flavour="llama", num_layers=61, hidden_size=7168, num_attention_heads=128,
                        ffn_hidden_size=18432, vocab_size=129280, seq_length=4096, norm_eps=1e-6,
                        rope_scaling=_yarn(40.0, 1.0), mla=dict(q_lora_rank=1536, **_DEEPSEEK_MLA),
                        moe=dict(num_experts=256, topk=8, ffn_hidden_size=2048, layer_freq=(0,) * 3 + (1,) * 58,
                                 num_groups=8, group_topk=4, topk_scaling_factor=2.5,
                                 shared_expert_intermediate_size=2048, **_DEEPSEEK_ROUTER)),
    "deepseek-v2-lite": dict(flavour="llama", num_layers=27, hidden_size=2048, num_attention_heads=16,
                             ffn_hidden_size=10944, vocab_size=102400, seq_length=4096, norm_eps=1e-6,
                             rope_scaling=_yarn(40.0, 0.707), mla=_DEEPSEEK_MLA,
                             moe=dict(num_experts=64, topk=6, ffn_hidden_size=1408, layer_freq=(0,) + (1,) * 26,
                                      pre_softmax=True, shared_expert_intermediate_size=2816, aux_loss_coeff=1e-3)),
    "moonlight-16b-a3b": dict(flavour="llama", num_layers=27, hidden_size=2048, num_attention_heads=16,
                              ffn_hidden_size=11264, vocab_size=163840, seq_length=4096, norm_eps=1e-5,
                              rope_theta=50000.0, mla=_DEEPSEEK_MLA,
                              moe=dict(num_experts=64, topk=6, ffn_hidden_size=1408, layer_freq=(0,) + (1,) * 26,
                                       topk_scaling_factor=2.446, shared_expert_intermediate_size=2816,
                                       **_DEEPSEEK_ROUTER)),
    # a tiny DeepSeek-V3-shaped model for tests and CPU runs: every piece above at small widths
    "deepseek-tiny": dict(flavour="llama", num_layers=3, hidden_size=128, num_attention_heads=4, ffn_hidden_size=352,
                          vocab_size=257, seq_length=64, norm_eps=1e-6,
                          mla=dict(q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                   v_head_dim=32),
                          moe=dict(num_experts=8, topk=2, ffn_hidden_size=64, layer_freq=(0, 1, 1), num_groups=4,
                                   group_topk=2, topk_scaling_factor=2.5, shared_expert_intermediate_size=64,
                                   **_DEEPSEEK_ROUTER)),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The named preset with explicit overrides (None values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    kwargs = dict(PRESETS[name])
    if overrides.get("hidden_size") is not None and overrides.get("ffn_hidden_size") is None \
            and kwargs.get("flavour") == "gpt2":
        kwargs.pop("ffn_hidden_size", None)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    moe = kwargs.get("moe")
    if isinstance(moe, dict) and isinstance(moe.get("layer_freq"), tuple):  # DeepSeek's first dense blocks, kept
        dense = moe["layer_freq"].index(1) if 1 in moe["layer_freq"] else len(moe["layer_freq"])
        layers = kwargs["num_layers"]
        kwargs["moe"] = {**moe, "layer_freq": (0,) * min(dense, layers) + (1,) * max(layers - dense, 0)}
    return GPTConfig(**kwargs)
