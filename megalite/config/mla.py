"""MLAConfig: multi-head latent attention (DeepSeek-V2/V3), pure Python, no torch.

Held by `GPTConfig.mla` (None: standard attention). The names follow Megatron-LM's flags
(`--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`, `--v-head-dim`);
transformers calls them q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim.

Per layer, for n heads and the model width h (the module: megalite/model/mla.py):

    q    = W_qb norm(W_qa x)      [n * (d_nope + d_rope)]   (q_lora_rank None: q = W_q x)
    c_kv, k_pe = W_kva x          [kv_lora_rank], [d_rope]  (k_pe: one RoPE key shared by the heads)
    k_nope, v = W_kvb norm(c_kv)  [n * d_nope], [n * d_v]
    k = [k_nope; k_pe]            d_qk = d_nope + d_rope per head; d_v may differ
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent c_kv (DeepSeek-V3: 512)."""
    q_lora_rank: int | None = None
    """Width of the compressed query latent (DeepSeek-V3: 1536); None: one full query projection
    (DeepSeek-V2-Lite)."""
    qk_head_dim: int = 128
    """Each head's query/key channels without position (Megatron's --qk-head-dim; HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """The RoPE channels of each query and of the one key shared by the heads (HF qk_rope_head_dim)."""
    v_head_dim: int = 128
    """Each head's value channels."""

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank must be >= 1 (or omitted: a full query projection), got "
                             f"{self.q_lora_rank}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)

    @property
    def qk_dim(self) -> int:
        """d_qk: a head's query/key channels, position included."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def params(self, hidden_size: int, heads: int, tp: int = 1) -> int:
        """Parameters of one attention layer held by one of `tp` ranks (no biases: DeepSeek has none): the
        down-projections and the latent norms whole (replicated), the rest split over the heads."""
        h, r_kv, r_q = hidden_size, self.kv_lora_rank, self.q_lora_rank
        replicated = h * (r_kv + self.qk_pos_emb_head_dim) + r_kv
        split = r_kv * heads * (self.qk_head_dim + self.v_head_dim) + heads * self.v_head_dim * h
        if r_q is None:
            split += h * heads * self.qk_dim
        else:
            replicated += h * r_q + r_q
            split += r_q * heads * self.qk_dim
        return replicated + split // tp

    def problems(self, hidden_size: int) -> list[str]:
        """What this MLA cannot run with a model of width `hidden_size`, each naming the fix."""
        out = []
        if self.kv_lora_rank > hidden_size:
            out.append(f"--kv-lora-rank {self.kv_lora_rank} is larger than --hidden-size {hidden_size}: the latent "
                       f"compresses the keys and values; choose a rank at most {hidden_size}")
        if self.q_lora_rank is not None and self.q_lora_rank > hidden_size:
            out.append(f"--q-lora-rank {self.q_lora_rank} is larger than --hidden-size {hidden_size}; choose a rank "
                       f"at most {hidden_size} (or omit it for a full query projection)")
        return out


MLA_SETTINGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def latent_attention(model, model_settings):
    """`model` (a GPTConfig) with the MLA settings given (--multi-latent-attention, --kv-lora-rank ...) over the
    preset's latent attention, if any (ValueError naming the fix)."""
    given = {name: getattr(model_settings, name) for name in MLA_SETTINGS if getattr(model_settings, name) is not None}
    if not given and not model_settings.multi_latent_attention:
        return model
    if model.mla is None and not model_settings.multi_latent_attention:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} configure latent attention but the model has none: add --multi-latent-attention "
                         f"(or a preset with it, e.g. --model deepseek-tiny)")
    base = dataclasses.asdict(model.mla) if model.mla is not None else {}
    return model.replace(mla=MLAConfig(**{**base, **given}))


def layout_problems(mla: MLAConfig | None, attention_dropout: float) -> list[str]:
    """What megalite's latent attention does not run yet, each naming the fix."""
    if mla is None or attention_dropout == 0:
        return []
    return ["--multi-latent-attention runs without attention dropout (torch's SDPA masks are not "
            "reproducible across layouts); set --attention-dropout 0"]
