"""transformers' deepseek_v2 / deepseek_v3 <-> megalite: the configs and the weight names.

DeepSeek-V3 (also Moonlight, Kimi K2): multi-head latent attention with a query latent, sigmoid
scores with the correction bias `e_score_correction_bias` (megalite's expert bias), group-limited
top-k, normalised weights times `routed_scaling_factor`, shared experts, the first
`first_k_dense_replace` blocks dense. DeepSeek-V2 (and V2-Lite: no query latent, no groups):
softmax over all experts, the k largest probabilities times the scaling factor (not normalised),
`group_limited_greedy` scoring a group by its best expert. The pieces: config/mla.py, moe/router.py.

Refused in one line: what either family has that megalite would approximate (biases on the
attention, V3 without interleaved RoPE or with unnormalised weights, a non-SiLU MLP).

Multi-token prediction (V3's `num_nextn_predict_layers` D): a checkpoint holds depth k (0-based) as
the extra layer L = num_hidden_layers + k, `model.layers.{L}.` followed by `enorm`, `hnorm`, `eh_proj`
(megalite's M_k [h, 2h], the normed embedding's columns first), `shared_head.norm` (the depth's final
norm), a whole decoder layer (always with experts) under its usual names, and copies of the shared
`embed_tokens` and `shared_head.head` (written on export, not read: the main model's are the ones).
megalite's depth k is `mtp.depths.{k}.` with its block under `block.`.
"""
from __future__ import annotations

import torch

from megalite.config.choices import MoEScoreFunction
from megalite.config.mla import MLAConfig
from megalite.config.model import GPTConfig
from megalite.config.moe import MoEConfig

FAMILIES = ("deepseek_v2", "deepseek_v3")


def _refusals(hf, family: str) -> list[str]:
    problems = []
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r} (megalite's gated MLP is SwiGLU)")
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        problems.append("attention or MLP biases")
    if family == "deepseek_v3" and not getattr(hf, "rope_interleave", True):
        problems.append("rope_interleave=False (megalite rotates DeepSeek's interleaved pairs)")
    if family == "deepseek_v3" and not getattr(hf, "norm_topk_prob", True):
        problems.append("norm_topk_prob=False with sigmoid scores")
    if family == "deepseek_v2" and getattr(hf, "topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
        problems.append(f"topk_method={hf.topk_method!r}")
    return problems


def _experts(hf, family: str) -> MoEConfig:
    groups = int(getattr(hf, "n_group", 1) or 1)
    grouped = groups > 1 and (family == "deepseek_v3" or hf.topk_method == "group_limited_greedy")
    shared = (getattr(hf, "n_shared_experts", 0) or 0) * hf.moe_intermediate_size
    dense = min(int(getattr(hf, "first_k_dense_replace", 0) or 0), hf.num_hidden_layers)
    scaling = float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0)
    kind = (dict(score_function="sigmoid", enable_expert_bias=True) if family == "deepseek_v3"
            else dict(pre_softmax=True))
    return MoEConfig(num_experts=hf.n_routed_experts, topk=hf.num_experts_per_tok,
                     ffn_hidden_size=hf.moe_intermediate_size, num_groups=groups if grouped else None,
                     group_topk=hf.topk_group if grouped else None,
                     topk_scaling_factor=None if scaling == 1.0 else scaling,
                     shared_expert_intermediate_size=shared or None,
                     layer_freq=(0,) * dense + (1,) * (hf.num_hidden_layers - dense) if dense else 1,
                     load_balancing_type="none", **kind)


def deepseek_config(hf, family: str, theta: float, scaling: dict | None) -> GPTConfig:
    """The GPTConfig of a deepseek_v2/v3 transformers config (RoPE's theta and scaling read by the caller)."""
    problems = _refusals(hf, family)
    if problems:
        raise ValueError(f"HF {family} with {', '.join(problems)} is not supported")
    mla = MLAConfig(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
                    qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim)
    return GPTConfig("llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                     num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
                     vocab_size=hf.vocab_size, seq_length=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
                     rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(hf.tie_word_embeddings),
                     add_bias=False, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)), mla=mla,
                     moe=_experts(hf, family) if getattr(hf, "n_routed_experts", None) else None,
                     mtp_num_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0) if family == "deepseek_v3"
                     else 0)


def family_of(config: GPTConfig) -> str:
    """deepseek_v3 for sigmoid scores (or no experts), deepseek_v2 for softmax ones."""
    return "deepseek_v2" if config.moe is not None and config.moe.score_function == MoEScoreFunction.SOFTMAX else "deepseek_v3"


def unexpressible(config: GPTConfig) -> list[str]:
    """What transformers' DeepSeek configs cannot express of `config` (each a phrase)."""
    moe, family = config.moe, family_of(config)
    problems = ["biases"] if config.qkv_bias or config.proj_bias or config.mlp_bias or config.qk_layernorm else []
    if moe is None:
        return problems + ["dense MLPs in every block (DeepSeek's configs have experts)"]
    layers = [moe.is_moe_layer(i) for i in range(config.num_layers)]
    if layers != sorted(layers):
        problems.append("dense blocks after MoE blocks (only first_k_dense_replace)")
    problems += [what for what, bad in (
        ("sigmoid scores without the expert bias", family == "deepseek_v3" and not moe.enable_expert_bias),
        ("softmax scores with renormalised top-k", family == "deepseek_v2" and not moe.pre_softmax),
        ("a shared expert gate or a capacity factor", moe.shared_expert_gate or moe.capacity_factor is not None),
        ("a shared expert not a multiple of the expert width",
         (moe.shared_expert_intermediate_size or 0) % moe.expert_ffn(config.ffn_hidden_size))) if bad]
    return problems


def expert_structure(config: GPTConfig) -> tuple:
    """What of the experts a transformers DeepSeek config carries (not the training-only balancing losses)."""
    moe = config.moe
    if moe is None:
        return ()
    return (moe.num_experts, moe.topk, moe.expert_ffn(config.ffn_hidden_size), moe.score_function, moe.pre_softmax,
            moe.enable_expert_bias, moe.num_groups, moe.group_topk, moe.topk_scaling_factor,
            moe.shared_expert_intermediate_size, [moe.is_moe_layer(i) for i in range(config.num_layers)])


def deepseek_keywords(config: GPTConfig) -> dict:
    """The transformers config keywords (RoPE excluded) of the DeepSeek family expressing `config`."""
    mla, moe = config.mla, config.moe
    width = moe.expert_ffn(config.ffn_hidden_size)
    dense = next((i for i in range(config.num_layers) if moe.is_moe_layer(i)), config.num_layers)
    kw = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
              num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
              max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_eps,
              tie_word_embeddings=config.tie_embeddings, attention_dropout=config.attention_dropout,
              intermediate_size=config.ffn_hidden_size, hidden_act="silu", attention_bias=False,
              q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_head_dim,
              qk_rope_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
              n_routed_experts=moe.num_experts, num_experts_per_tok=moe.topk, moe_intermediate_size=width,
              n_shared_experts=(moe.shared_expert_intermediate_size or 0) // width,
              routed_scaling_factor=moe.topk_scaling_factor or 1.0, first_k_dense_replace=dense,
              n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1)
    if family_of(config) == "deepseek_v3":
        kw.update(norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=config.mtp_num_layers)
    else:
        kw.update(topk_method="group_limited_greedy" if moe.num_groups else "greedy", mlp_bias=False)
    return kw


def _swiglu_rows(hf_module: str, module: str, f: int) -> list:
    """A SwiGLU MLP: HF's gate/up/down Linears <-> megalite's fc1 [gate; up] and fc2."""
    return [((hf_module + "gate_proj.weight", hf_module + "up_proj.weight"), module + "fc1.weight", ("cat", (f, f))),
            ((hf_module + "down_proj.weight",), module + "fc2.weight", "copy")]


def deepseek_rows(config: GPTConfig) -> list[tuple[tuple[str, ...], str, object]]:
    """hf.py's name table for a model with latent attention: (HF names, megalite logical name, how)."""
    rows = [(("model.embed_tokens.weight",), "word_embeddings.weight", "copy"),
            (("model.norm.weight",), "final_norm.weight", "copy")]
    if not config.tie_embeddings:
        rows.append((("lm_head.weight",), "output_weight", "copy"))
    attention = [("kv_a_proj_with_mqa.weight", "kv_down"), ("kv_a_layernorm.weight", "kv_norm.weight"),
                 ("kv_b_proj.weight", "kv_up.weight"), ("o_proj.weight", "proj.weight")]
    if config.mla.q_lora_rank is None:
        attention.append(("q_proj.weight", "q_up.weight"))
    else:
        attention += [("q_a_proj.weight", "q_down"), ("q_a_layernorm.weight", "q_norm.weight"),
                      ("q_b_proj.weight", "q_up.weight")]
    for layer_id, p, q in block_prefixes(config):
        rows += [((p + "input_layernorm.weight",), q + "input_norm.weight", "copy"),
                 ((p + "post_attention_layernorm.weight",), q + "post_attention_norm.weight", "copy")]
        rows += [((p + "self_attn." + hf_name,), q + "attention." + name, "copy") for hf_name, name in attention]
        if not config.is_moe_block(layer_id):
            rows += _swiglu_rows(p + "mlp.", q + "mlp.", config.ffn_hidden_size)
            continue
        rows.append(((p + "mlp.gate.weight",), q + "mlp.router.weight", "copy"))
        if config.moe.shared_expert_intermediate_size:
            rows += _swiglu_rows(p + "mlp.shared_experts.", q + "mlp.shared_expert.",
                                 config.moe.shared_expert_intermediate_size)
    for k in range(config.mtp_num_layers):  # each depth's own pieces around its block
        p, q = f"model.layers.{config.num_layers + k}.", f"mtp.depths.{k}."
        rows += [((p + hf_name,), q + name, "copy") for hf_name, name in (
            ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
            ("shared_head.norm.weight", "final_norm.weight"))]
    return rows


def block_prefixes(config: GPTConfig) -> list[tuple[int, str, str]]:
    """(layer id, HF prefix, megalite prefix) of every transformer block: the model's, then MTP's depths
    (HF's extra layers num_hidden_layers + k)."""
    return ([(i, f"model.layers.{i}.", f"layers.{i}.") for i in range(config.num_layers)]
            + [(config.num_layers + k, f"model.layers.{config.num_layers + k}.", f"mtp.depths.{k}.block.")
               for k in range(config.mtp_num_layers)])


def mtp_shared_copies(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name, megalite logical name) of the embedding and head copies a checkpoint keeps in each MTP layer."""
    head = "word_embeddings.weight" if config.tie_embeddings else "output_weight"
    return [name for k in range(config.mtp_num_layers) for name in (
        (f"model.layers.{config.num_layers + k}.embed_tokens.weight", "word_embeddings.weight"),
        (f"model.layers.{config.num_layers + k}.shared_head.head.weight", head))]


def expert_bias_names(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name, megalite logical name) of each expert bias: buffers, which a full state carries beside the
    parameters when the HF state has them (a state of gradients has not)."""
    moe = config.moe
    if moe is None or not moe.enable_expert_bias:
        return []
    return [(f"{p}mlp.gate.e_score_correction_bias", f"{q}mlp.router.expert_bias")
            for layer_id, p, q in block_prefixes(config) if config.is_moe_block(layer_id)]


@torch.no_grad()
def load_expert_biases(model, full: dict[str, torch.Tensor]) -> None:
    """Copy the expert biases in `full` (logical names) into this stage's routers."""
    for name, module in model.named_modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor):
            logical = model.logical_name(f"{name}.expert_bias")
            if logical in full:
                bias.copy_(full[logical].to(bias.dtype))
