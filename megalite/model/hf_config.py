"""transformers config <-> GPTConfig, for every family megalite converts, in one place.

Families (HF `model_type`): gpt2; llama (Llama 2/3.x: rope scaling "llama3", tied embeddings for
3.2 1B/3B, attention/MLP biases, head_dim); mistral (as llama, with its sliding window); qwen2 (q/k/v
biases; a window on some layers only is refused); qwen3 (q/k RMSNorms, head_dim); mixtral (and its
window), qwen3_moe and qwen2_moe (softmax top-k experts in every block; Qwen2-MoE adds a sigmoid-gated
shared expert); deepseek_v2 and deepseek_v3 (latent attention, group-limited routing:
megalite/model/hf_deepseek.py).

`config_from_hf` reads one; `hf_config_from` writes the family that expresses a GPTConfig and
checks that reading it back reproduces the model. Anything megalite would have to approximate
raises ValueError in one line naming it.
"""
from __future__ import annotations

import torch

from megalite.config.choices import MoEScoreFunction
from megalite.config.model import GPTConfig
from megalite.config.rope_scaling import rope_type
from megalite.data.tokenizer import load_tokenizer
from megalite.extras import require
from megalite.model import hf_deepseek
from megalite.config.moe import MoEConfig

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", *hf_deepseek.FAMILIES)
_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "mistral": "MistralForCausalLM"}


def _gpt2_config(hf) -> GPTConfig:
    if getattr(hf, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {hf.activation_function!r} unsupported; megalite uses tanh-GeLU")
    # megalite drops the embedding output and both residual branches with one probability (as Megatron)
    resid, embd, attn = (float(getattr(hf, name, 0.0)) for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    if embd != resid:
        raise ValueError(f"GPT-2 embd_pdrop={embd} differs from resid_pdrop={resid}; megalite uses one hidden_dropout "
                         "for the embedding and the residual branches: set both to the same value")
    return GPTConfig("gpt2", num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
                     ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, vocab_size=hf.vocab_size, seq_length=hf.n_positions,
                     norm_eps=hf.layer_norm_epsilon, tie_embeddings=True, add_bias=True, hidden_dropout=resid,
                     attention_dropout=attn)


def _rope(hf) -> tuple[float, dict | None]:
    """(theta, scaling) from rope_theta/rope_scaling (transformers < 5) or rope_parameters (>= 5)."""
    parameters = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = getattr(hf, "rope_theta", None) or parameters.get("rope_theta", 10000.0)
    if rope_type(parameters) == "default":
        return float(theta), None
    scaling = {k: v for k, v in parameters.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type(parameters)
    return float(theta), scaling


def _sliding_window(hf, family: str) -> int | None:
    """Mistral's and Mixtral's window (every layer; None when it covers the context). Qwen's windows apply
    to the layers from max_window_layers on (transformers' layer_types): none when no layer slides, the
    window when every layer does (Qwen2, Qwen3); a window on some layers only is refused."""
    window = getattr(hf, "sliding_window", None)
    used = getattr(hf, "use_sliding_window", True)  # Qwen keeps a window size it does not use
    if not (used and window and window < hf.max_position_embeddings):
        return None
    if family in ("mistral", "mixtral"):
        return int(window)
    sliding = [kind == "sliding_attention" for kind in (getattr(hf, "layer_types", None) or ())]
    if sliding and not any(sliding):
        return None  # every layer below max_window_layers: transformers applies no window
    if sliding and all(sliding) and family in ("qwen2", "qwen3"):
        return int(window)
    raise ValueError(f"{family} sliding_window={window} < max_position_embeddings={hf.max_position_embeddings} "
                     f"is not supported (a window on some layers only); set use_sliding_window=False")


def _decoder_config(hf, family: str) -> GPTConfig:
    """The attention, norms and dense MLP shared by the llama-flavour families."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{family} hidden_act={hf.hidden_act!r} is not supported; megalite's gated MLP is SwiGLU")
    window = _sliding_window(hf, family)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    qkv_bias, proj_bias = (attention_bias, attention_bias)
    if family == "qwen2":
        qkv_bias, proj_bias = True, False
    if family == "qwen2_moe":
        qkv_bias, proj_bias = bool(getattr(hf, "qkv_bias", True)), False
    nq = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // nq
    theta, scaling = _rope(hf)
    return GPTConfig("llama", num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=nq,
                     num_query_groups=getattr(hf, "num_key_value_heads", None) or nq,
                     ffn_hidden_size=hf.intermediate_size, vocab_size=hf.vocab_size,
                     seq_length=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps, rope_theta=theta,
                     rope_scaling=scaling, tie_embeddings=bool(hf.tie_word_embeddings), add_bias=False,
                     qkv_bias=qkv_bias, proj_bias=proj_bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)),
                     kv_channels=head_dim if head_dim * nq != hf.hidden_size else None,
                     qk_layernorm=family in ("qwen3", "qwen3_moe"),
                     attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),  # no hidden dropout
                     window_size=window)


def _experts(hf, family: str) -> MoEConfig:
    aux = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
    if family == "mixtral":
        return MoEConfig(num_experts=hf.num_local_experts, topk=hf.num_experts_per_tok, aux_loss_coeff=aux)
    if hf.decoder_sparse_step != 1 or list(hf.mlp_only_layers or []):
        raise ValueError(f"{family} with decoder_sparse_step={hf.decoder_sparse_step}, mlp_only_layers="
                         f"{hf.mlp_only_layers} is not supported; megalite converts experts in every block")
    # norm_topk_prob: renormalised top-k (Mixtral's rule); else the k largest of the softmax over all experts
    shared = getattr(hf, "shared_expert_intermediate_size", None) if family == "qwen2_moe" else None
    return MoEConfig(num_experts=hf.num_experts, topk=hf.num_experts_per_tok, ffn_hidden_size=hf.moe_intermediate_size,
                     pre_softmax=not hf.norm_topk_prob, aux_loss_coeff=aux, shared_expert_intermediate_size=shared,
                     shared_expert_gate=bool(shared))


def config_from_hf(hf_config) -> GPTConfig:
    """The GPTConfig of a transformers config (dropout probabilities included); refuses in one line."""
    family = getattr(hf_config, "model_type", "")
    if family not in SUPPORTED:
        raise ValueError(f"unsupported HF model_type {family!r}; megalite converts {', '.join(SUPPORTED)}")
    if family == "gpt2":
        return _gpt2_config(hf_config)
    if family in hf_deepseek.FAMILIES:
        return hf_deepseek.deepseek_config(hf_config, family, *_rope(hf_config))
    config = _decoder_config(hf_config, family)
    if family in ("mixtral", "qwen3_moe", "qwen2_moe"):
        config = config.replace(moe=_experts(hf_config, family))
    return config


def family_of(config: GPTConfig) -> str:
    """The transformers family that expresses `config` exactly (Mistral models export as llama, but for
    a sliding window)."""
    if config.flavour == "gpt2":
        return "gpt2"
    if config.mla is not None:
        return hf_deepseek.family_of(config)
    if config.moe is not None:
        if config.moe.shared_expert_gate:
            return "qwen2_moe"
        return "qwen3_moe" if config.qk_layernorm else "mixtral"
    if config.qk_layernorm:
        return "qwen3"
    if config.qkv_bias and not config.proj_bias and not config.mlp_bias:
        return "qwen2"
    return "mistral" if config.window_size is not None else "llama"


def _unexpressible(config: GPTConfig, family: str) -> list[str]:
    """What `family` cannot express of `config` (each a phrase)."""
    problems = []
    if family in hf_deepseek.FAMILIES:
        return hf_deepseek.unexpressible(config)
    if family == "gpt2":
        if not config.tie_embeddings or not config.add_bias:
            problems.append(f"untied embeddings or no biases (tie_embeddings={config.tie_embeddings}, "
                            f"add_bias={config.add_bias})")
        return problems
    if family not in ("qwen2", "qwen2_moe") and config.qkv_bias != config.proj_bias:
        problems.append(f"qkv_bias={config.qkv_bias} with proj_bias={config.proj_bias}")
    if family == "qwen2_moe" and (config.qk_layernorm or config.proj_bias):
        problems.append("q/k norms or an output projection bias")
    if family in ("qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe") and config.mlp_bias:
        problems.append("MLP biases")
    if family != "llama" and config.rope_scaling:
        problems.append(f"rope_scaling {config.rope_scaling}")
    if family not in ("mistral", "mixtral", "qwen2", "qwen3") and config.window_size is not None:
        problems.append(f"a sliding window (window_size={config.window_size})")
    moe = config.moe
    if moe is not None:
        problems += [what for what, bad in (
            ("--moe-layer-freq > 1", moe.layer_freq != 1), ("sigmoid scores", moe.score_function != MoEScoreFunction.SOFTMAX),
            ("--moe-router-pre-softmax without q/k norms (Qwen2-MoE is not built)",
             moe.pre_softmax and family == "mixtral"),
            ("a shared expert without its gate (only Qwen2-MoE has one, gated)",
             bool(moe.shared_expert_intermediate_size) and not moe.shared_expert_gate),
            ("expert bias", moe.enable_expert_bias),
            ("a capacity factor", moe.capacity_factor is not None)) if bad]
    return problems


def _decoder_keywords(config: GPTConfig, family: str) -> dict:
    kw = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
              num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_query_groups,
              head_dim=config.head_dim, max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_eps,
              tie_word_embeddings=config.tie_embeddings, attention_dropout=config.attention_dropout,
              intermediate_size=config.ffn_hidden_size, hidden_act="silu")
    if family == "qwen2_moe":
        kw["qkv_bias"] = config.qkv_bias
    elif family != "qwen2":
        kw["attention_bias"] = config.qkv_bias
    if family == "llama":
        kw["mlp_bias"] = config.mlp_bias
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        kw.update(use_sliding_window=False, sliding_window=None)
        if config.window_size is not None:  # Qwen2 and Qwen3: every layer slides (from layer 0 on)
            kw.update(use_sliding_window=True, sliding_window=config.window_size, max_window_layers=0)
    if family == "mistral":
        kw["sliding_window"] = config.window_size
    if family == "mixtral":
        moe = config.moe
        kw.update(sliding_window=config.window_size, num_local_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                  router_aux_loss_coef=moe.aux_loss_coeff, intermediate_size=moe.expert_ffn(config.ffn_hidden_size))
    if family in ("qwen3_moe", "qwen2_moe"):
        moe = config.moe
        kw.update(num_experts=moe.num_experts, num_experts_per_tok=moe.topk, norm_topk_prob=not moe.pre_softmax,
                  moe_intermediate_size=moe.expert_ffn(config.ffn_hidden_size), decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=moe.aux_loss_coeff)
    if family == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    return kw


def _gpt2_keywords(config: GPTConfig) -> dict:
    return dict(vocab_size=config.vocab_size, n_positions=config.seq_length, n_embd=config.hidden_size,
                n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
                activation_function="gelu_new", layer_norm_epsilon=config.norm_eps,
                resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                attn_pdrop=config.attention_dropout, tie_word_embeddings=True)


def _rope_keywords(config: GPTConfig, hf_class) -> dict:
    """RoPE as the installed transformers spells it: rope_parameters (>= 5) or rope_theta + rope_scaling."""
    scaling = dict(config.rope_scaling or {"rope_type": "default"})
    if "rope_parameters" in hf_class().to_dict():
        return {"rope_parameters": {**scaling, "rope_theta": config.rope_theta}}
    return {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}


_CHECKED_FIELDS = ("flavour", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size",
                   "seq_length", "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings", "qkv_bias",
                   "proj_bias", "mlp_bias", "head_dim", "qk_layernorm")


def hf_config_from(config: GPTConfig, dtype: torch.dtype = torch.float32, *, bos_token_id: int | None = None,
                   eos_token_id: int | None = None):
    """The transformers config of the same model, with the tokenizer's bos/eos ids (each an int or a list;
    None: the last vocabulary id, megalite's end-of-document token by default). Checked by reading it back."""
    transformers = require("transformers", "a transformers config (hf_config_from)")  # the [hf] extra
    family = family_of(config)
    problems = _unexpressible(config, family)
    if problems:
        raise ValueError(f"{_ARCHITECTURES[family]} cannot express {', '.join(problems)}; export a model without it")
    class_name = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "mistral": "MistralConfig",
                  "qwen2_moe": "Qwen2MoeConfig", "deepseek_v2": "DeepseekV2Config",
                  "deepseek_v3": "DeepseekV3Config"}[family]
    hf_class = getattr(transformers, class_name)
    if family == "gpt2":
        keywords = _gpt2_keywords(config)
    elif family in hf_deepseek.FAMILIES:
        keywords = {**hf_deepseek.deepseek_keywords(config), **_rope_keywords(config, hf_class)}
    else:
        keywords = {**_decoder_keywords(config, family), **_rope_keywords(config, hf_class)}
    default_id = config.vocab_size - 1
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        value = default_id if value is None else value  # an int, or a list (Llama 3.1 Instruct's eos ids)
        ids = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
        if not all(0 <= v < config.vocab_size for v in ids):
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {config.vocab_size}); pass the "
                             f"tokenizer the model was trained with")
        keywords[name] = ids if isinstance(value, (list, tuple)) else ids[0]
    keywords["pad_token_id"] = None
    hf = hf_class(**keywords)
    hf.architectures = [_ARCHITECTURES[family]]
    setattr(hf, "dtype" if "dtype" in hf.to_dict() else "torch_dtype", str(dtype).removeprefix("torch."))
    _check_round_trip(config, config_from_hf(hf))
    return hf


def _expert_shape(config: GPTConfig) -> tuple:
    moe = config.moe
    return (moe.num_experts, moe.topk, moe.pre_softmax, moe.expert_ffn(config.ffn_hidden_size),
            moe.shared_expert_intermediate_size, moe.shared_expert_gate)


def _check_round_trip(config: GPTConfig, back: GPTConfig) -> None:
    fields = list(_CHECKED_FIELDS) + ["mla"]
    if config.mla is not None:  # DeepSeek: the experts as its config has them, the dense blocks' width
        fields = [f for f in fields if f != "head_dim"] + ["ffn_hidden_size"]
        if hf_deepseek.expert_structure(back) != hf_deepseek.expert_structure(config):
            raise ValueError(f"the transformers config does not reproduce the experts: {back.moe} != {config.moe}")
    elif config.moe is None:
        fields.append("ffn_hidden_size")
    elif _expert_shape(back) != _expert_shape(config):
        raise ValueError(f"the transformers config does not reproduce the experts: {back.moe} != {config.moe}")
    for field in fields:
        if getattr(back, field) != getattr(config, field):
            raise ValueError(f"the transformers config does not reproduce {field}: {getattr(back, field)} != "
                             f"{getattr(config, field)}")


BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|im_start|>", "[CLS]")


def special_token_ids(tokenizer_spec: str) -> tuple[int, int]:
    """(bos, eos) ids of a run's tokenizer ("byte" or a tokenizer.json path). eos is its end-of-document
    id; bos the first of BOS_NAMES it holds, else eos (GPT-2's convention: one id for both)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    eos = int(tokenizer.eod)
    hf_tokenizer = getattr(tokenizer, "_tokenizer", None)
    for name in BOS_NAMES if hf_tokenizer is not None else ():
        token_id = hf_tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id), eos
    return eos, eos
