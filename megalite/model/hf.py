"""HuggingFace interop: GPT2LMHeadModel / LlamaForCausalLM <-> megalite, by full tensors.

Names on the megalite side are the *logical* names of the full pp=1 model (see
`GPTModel.logical_name`), so the same mapping serves `from_hf`, checkpoint export and import.
GPT-2's Conv1D stores weights as [in, out]; megalite (like nn.Linear) stores [out, in].
"""
from __future__ import annotations

import torch

from megalite.model.config import GPTConfig


def config_from_hf(hf_config) -> GPTConfig:
    kind = getattr(hf_config, "model_type", "")
    if kind == "gpt2":
        if getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} unsupported; megalite uses tanh-GeLU")
        return GPTConfig("gpt2", num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                         num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                         vocab_size=hf_config.vocab_size, seq_length=hf_config.n_positions,
                         norm_eps=hf_config.layer_norm_epsilon, tie_embeddings=True, add_bias=True)
    if kind == "llama":
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise ValueError("Llama with attention_bias/mlp_bias is not supported")
        scaling = getattr(hf_config, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"Llama rope_scaling {scaling} is not supported (plain RoPE only)")
        theta = getattr(hf_config, "rope_theta", None)
        if theta is None:  # newer transformers keep it in rope_parameters
            theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return GPTConfig("llama", num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                         num_attention_heads=hf_config.num_attention_heads,
                         num_query_groups=hf_config.num_key_value_heads, ffn_hidden_size=hf_config.intermediate_size,
                         vocab_size=hf_config.vocab_size, seq_length=hf_config.max_position_embeddings,
                         norm_eps=hf_config.rms_norm_eps, rope_theta=float(theta),
                         tie_embeddings=bool(hf_config.tie_word_embeddings), add_bias=False)
    raise ValueError(f"unsupported HF model_type {kind!r}; megalite converts gpt2 and llama")


def hf_to_full_state(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> megalite logical full tensors."""
    sd = {k.removeprefix("model.").removeprefix("transformer."): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}
    if config.flavour == "gpt2":
        out["word_embeddings.weight"] = sd["wte.weight"]
        out["position_embeddings"] = sd["wpe.weight"]
        out["final_norm.weight"], out["final_norm.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
        for i in range(config.num_layers):
            p, q = f"h.{i}.", f"layers.{i}."
            for hf_name, name in (("ln_1", "input_norm"), ("ln_2", "post_attention_norm")):
                out[q + name + ".weight"], out[q + name + ".bias"] = sd[p + hf_name + ".weight"], sd[p + hf_name + ".bias"]
            for hf_name, name in (("attn.c_attn", "attention.qkv"), ("attn.c_proj", "attention.proj"),
                                  ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[q + name + ".weight"] = sd[p + hf_name + ".weight"].t().contiguous()  # Conv1D [in, out]
                out[q + name + ".bias"] = sd[p + hf_name + ".bias"]
        return out
    out["word_embeddings.weight"] = sd["embed_tokens.weight"]
    out["final_norm.weight"] = sd["norm.weight"]
    if not config.tie_embeddings:
        out["output_weight"] = sd["lm_head.weight"]
    for i in range(config.num_layers):
        p, q = f"layers.{i}.", f"layers.{i}."
        out[q + "input_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "post_attention_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[q + "attention.qkv.weight"] = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[q + "attention.proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "mlp.fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[q + "mlp.fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def full_state_to_hf(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """megalite logical full tensors -> HF state dict (the inverse of `hf_to_full_state`)."""
    out: dict[str, torch.Tensor] = {}
    if config.flavour == "gpt2":
        out["transformer.wte.weight"] = full["word_embeddings.weight"]
        out["lm_head.weight"] = full["word_embeddings.weight"]
        out["transformer.wpe.weight"] = full["position_embeddings"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = full["final_norm.weight"], full["final_norm.bias"]
        for i in range(config.num_layers):
            p, q = f"transformer.h.{i}.", f"layers.{i}."
            for hf_name, name in (("ln_1", "input_norm"), ("ln_2", "post_attention_norm")):
                out[p + hf_name + ".weight"], out[p + hf_name + ".bias"] = full[q + name + ".weight"], full[q + name + ".bias"]
            for hf_name, name in (("attn.c_attn", "attention.qkv"), ("attn.c_proj", "attention.proj"),
                                  ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[p + hf_name + ".weight"] = full[q + name + ".weight"].t().contiguous()
                out[p + hf_name + ".bias"] = full[q + name + ".bias"]
        return out
    d, nq, nkv, f = config.head_dim, config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    out["model.embed_tokens.weight"] = full["word_embeddings.weight"]
    out["model.norm.weight"] = full["final_norm.weight"]
    out["lm_head.weight"] = full["word_embeddings.weight" if config.tie_embeddings else "output_weight"]
    for i in range(config.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = full[q + "input_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = full[q + "post_attention_norm.weight"]
        wq, wk, wv = full[q + "attention.qkv.weight"].split([nq * d, nkv * d, nkv * d])
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = wq, wk
        out[p + "self_attn.v_proj.weight"] = wv
        out[p + "self_attn.o_proj.weight"] = full[q + "attention.proj.weight"]
        gate, up = full[q + "mlp.fc1.weight"].split([f, f])
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = full[q + "mlp.fc2.weight"]
    return out


def from_hf(hf_model, mesh=None, **model_kwargs):
    """The megalite GPTModel equal to `hf_model`, with this rank's slices of its weights."""
    from megalite.model.gpt import GPTModel

    config = config_from_hf(hf_model.config)
    model = GPTModel(config, mesh, **model_kwargs)
    hf_state = {k: v.detach().to(torch.float32) for k, v in hf_model.state_dict().items()}
    model.load_full_state_dict(hf_to_full_state(hf_state, config))
    return model
