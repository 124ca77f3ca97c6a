"""HuggingFace interop: GPT2LMHeadModel / LlamaForCausalLM / MixtralForCausalLM <-> megalite, by full tensors.

Names on the megalite side are the *logical* names of the full pp=1 model (see
`GPTModel.logical_name`); one name table serves `from_hf`, checkpoint export and import.
GPT-2's Conv1D stores weights as [in, out]; megalite (like nn.Linear) stores [out, in].

Mixtral: the router `mlp.gate.weight` [E, h] is megalite's `mlp.router.weight`; the experts are
stacked in transformers >= 5 (`mlp.experts.gate_up_proj` [E, 2f, h] = [gate; up] per expert,
`mlp.experts.down_proj` [E, h, f]) and separate before (`block_sparse_moe.experts.{e}.w1/w3/w2`);
megalite holds one tensor per expert (`mlp.experts.{e}.fc1_weight` [2f, h], `fc2_weight` [h, f]).
Both HF layouts are read; the stacked one is written.
"""
from __future__ import annotations

import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.moe.config import MoEConfig


def _gpt2_dropout(hf_config) -> tuple[float, float]:
    """(hidden_dropout, attention_dropout) from GPT-2's resid/embd/attn_pdrop.

    megalite drops the embedding output and both residual branches with one probability,
    hidden_dropout (as Megatron does), so embd_pdrop must equal resid_pdrop."""
    resid, embd, attn = (float(getattr(hf_config, name, 0.0)) for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    if embd != resid:
        raise ValueError(f"GPT-2 embd_pdrop={embd} differs from resid_pdrop={resid}; megalite uses one hidden_dropout "
                         "for the embedding and the residual branches: set both to the same value")
    return resid, attn


def config_from_hf(hf_config) -> GPTConfig:
    """The GPTConfig of a transformers GPT2Config / LlamaConfig, dropout probabilities included."""
    kind = getattr(hf_config, "model_type", "")
    if kind == "gpt2":
        if getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} unsupported; megalite uses tanh-GeLU")
        hidden_dropout, attention_dropout = _gpt2_dropout(hf_config)
        return GPTConfig("gpt2", num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                         num_attention_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                         vocab_size=hf_config.vocab_size, seq_length=hf_config.n_positions,
                         norm_eps=hf_config.layer_norm_epsilon, tie_embeddings=True, add_bias=True,
                         hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
    if kind == "mixtral":
        if getattr(hf_config, "sliding_window", None):
            raise ValueError(f"Mixtral sliding_window={hf_config.sliding_window} is not supported (full causal "
                             f"attention only); set sliding_window=None")
        dense = _llama_config(hf_config)
        moe = MoEConfig(num_experts=hf_config.num_local_experts, topk=hf_config.num_experts_per_tok,
                        aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)))
        return dense.replace(moe=moe)
    if kind == "llama":
        return _llama_config(hf_config)
    raise ValueError(f"unsupported HF model_type {kind!r}; megalite converts gpt2, llama and mixtral")


def _llama_config(hf_config) -> GPTConfig:
    """Llama's (and Mixtral's attention and norms') GPTConfig."""
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
                     tie_embeddings=bool(hf_config.tie_word_embeddings), add_bias=False,
                     attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)))  # no hidden dropout


# One table serves both directions: (HF names, megalite logical name, how). "copy": the same
# tensor; "transpose": GPT-2's Conv1D [in, out] <-> [out, in]; ("cat", sizes): HF's separate
# tensors stacked along dim 0 into a fused megalite weight ([Q; K; V], [gate; up]).
def _name_table(config: GPTConfig) -> list[tuple[tuple[str, ...], str, object]]:
    rows: list[tuple[tuple[str, ...], str, object]] = []
    if config.flavour == "gpt2":
        rows += [(("transformer.wte.weight",), "word_embeddings.weight", "copy"),
                 (("transformer.wpe.weight",), "position_embeddings", "copy"),
                 (("transformer.ln_f.weight",), "final_norm.weight", "copy"),
                 (("transformer.ln_f.bias",), "final_norm.bias", "copy")]
        for i in range(config.num_layers):
            p, q = f"transformer.h.{i}.", f"layers.{i}."
            for hf_name, name in (("ln_1", "input_norm"), ("ln_2", "post_attention_norm")):
                rows += [((p + hf_name + ".weight",), q + name + ".weight", "copy"),
                         ((p + hf_name + ".bias",), q + name + ".bias", "copy")]
            for hf_name, name in (("attn.c_attn", "attention.qkv"), ("attn.c_proj", "attention.proj"),
                                  ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                rows += [((p + hf_name + ".weight",), q + name + ".weight", "transpose"),
                         ((p + hf_name + ".bias",), q + name + ".bias", "copy")]
        return rows
    d, nq, nkv, f = config.head_dim, config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    rows += [(("model.embed_tokens.weight",), "word_embeddings.weight", "copy"),
             (("model.norm.weight",), "final_norm.weight", "copy")]
    if not config.tie_embeddings:
        rows.append((("lm_head.weight",), "output_weight", "copy"))
    for i in range(config.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        rows += [((p + "input_layernorm.weight",), q + "input_norm.weight", "copy"),
                 ((p + "post_attention_layernorm.weight",), q + "post_attention_norm.weight", "copy"),
                 (tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), q + "attention.qkv.weight",
                  ("cat", (nq * d, nkv * d, nkv * d))),
                 ((p + "self_attn.o_proj.weight",), q + "attention.proj.weight", "copy")]
        if config.moe is not None:  # Mixtral: the router here, the experts in _expert_tensors
            rows.append(((p + "mlp.gate.weight",), q + "mlp.router.weight", "copy"))
            continue
        rows += [((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), q + "mlp.fc1.weight", ("cat", (f, f))),
                 ((p + "mlp.down_proj.weight",), q + "mlp.fc2.weight", "copy")]
    return rows


def _experts_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Mixtral's experts (either HF layout) -> megalite's per-expert logical tensors."""
    out = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        stacked = p + "mlp.experts.gate_up_proj" in hf_state
        if p + "block_sparse_moe.gate.weight" in hf_state:  # transformers < 5 names the router here
            hf_state[p + "mlp.gate.weight"] = hf_state[p + "block_sparse_moe.gate.weight"]
        for e in range(config.moe.num_experts):
            q = f"layers.{i}.mlp.experts.{e}."
            if stacked:
                out[q + "fc1_weight"] = hf_state[p + "mlp.experts.gate_up_proj"][e]
                out[q + "fc2_weight"] = hf_state[p + "mlp.experts.down_proj"][e]
            else:
                old = f"{p}block_sparse_moe.experts.{e}."
                out[q + "fc1_weight"] = torch.cat([hf_state[old + "w1.weight"], hf_state[old + "w3.weight"]])
                out[q + "fc2_weight"] = hf_state[old + "w2.weight"]
    return out


def _experts_to_hf(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """megalite's per-expert tensors -> Mixtral's stacked experts (transformers >= 5 layout)."""
    out = {}
    for i in range(config.num_layers):
        q = f"layers.{i}.mlp.experts."
        experts = range(config.moe.num_experts)
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([full[f"{q}{e}.fc1_weight"] for e in experts])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([full[f"{q}{e}.fc2_weight"] for e in experts])
    return out


def hf_to_full_state(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> megalite logical full tensors."""
    out: dict[str, torch.Tensor] = _experts_from_hf(dict(hf_state), config) if config.moe is not None else {}
    if config.moe is not None:  # transformers < 5 names the router block_sparse_moe.gate
        hf_state = {k.replace(".block_sparse_moe.gate.", ".mlp.gate."): v for k, v in hf_state.items()}
    for hf_names, name, how in _name_table(config):
        tensors = [hf_state[n] for n in hf_names]
        if how == "transpose":
            out[name] = tensors[0].t().contiguous()
        elif how == "copy":
            out[name] = tensors[0]
        else:
            out[name] = torch.cat(tensors)
    return out


def full_state_to_hf(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """megalite logical full tensors -> HF state dict (the inverse of `hf_to_full_state`)."""
    out: dict[str, torch.Tensor] = _experts_to_hf(full, config) if config.moe is not None else {}
    for hf_names, name, how in _name_table(config):
        if how == "transpose":
            out[hf_names[0]] = full[name].t().contiguous()
        elif how == "copy":
            out[hf_names[0]] = full[name]
        else:
            out.update(zip(hf_names, full[name].split(list(how[1]))))
    if config.tie_embeddings:  # HF keeps the tied head under its own name
        out["lm_head.weight"] = full["word_embeddings.weight"]
    return out


def from_hf(hf_model, mesh=None, **model_kwargs):
    """The megalite GPTModel equal to `hf_model`, with this rank's slices of its weights."""
    config = config_from_hf(hf_model.config)
    model = GPTModel(config, mesh, **model_kwargs)
    hf_state = {k: v.detach().to(torch.float32) for k, v in hf_model.state_dict().items()}
    model.load_full_state_dict(hf_to_full_state(hf_state, config))
    return model
