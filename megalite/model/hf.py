"""HuggingFace interop: GPT-2, Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Mixtral and Qwen3-MoE <-> megalite,
by full tensors (the configs: megalite/model/hf_config.py).

Names on the megalite side are the *logical* names of the full pp=1 model (see
`GPTModel.logical_name`); one name table serves `from_hf`, checkpoint export and import.
GPT-2's Conv1D stores weights as [in, out]; megalite (like nn.Linear) stores [out, in].

Mixtral and Qwen3-MoE: the router `mlp.gate.weight` [E, h] is megalite's `mlp.router.weight`; the experts are
stacked in transformers >= 5 (`mlp.experts.gate_up_proj` [E, 2f, h] = [gate; up] per expert,
`mlp.experts.down_proj` [E, h, f]) and separate before (`block_sparse_moe.experts.{e}.w1/w3/w2`);
megalite holds one tensor per expert (`mlp.experts.{e}.fc1_weight` [2f, h], `fc2_weight` [h, f]).
All three HF layouts are read (Qwen-MoE's files hold `mlp.experts.{e}.gate_proj/up_proj/down_proj`);
the stacked one is written.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params
from megalite.config.model import GPTConfig
from megalite.extras import require
from megalite.model.gpt import GPTModel
from megalite.model.hf_deepseek import (block_prefixes, deepseek_rows, expert_bias_names, load_expert_biases,
                                        mtp_shared_copies)
from megalite.model.hf_config import config_from_hf, hf_config_from  # noqa: F401 - the configs' one place


# One table serves both directions: (HF names, megalite logical name, how). "copy": the same
# tensor; "transpose": GPT-2's Conv1D [in, out] <-> [out, in]; ("cat", sizes): HF's separate
# tensors stacked along dim 0 into a fused megalite weight ([Q; K; V], [gate; up]).
def _name_table(config: GPTConfig) -> list[tuple[tuple[str, ...], str, object]]:
    if config.mla is not None:  # DeepSeek-V2/V3: latent attention, dense first blocks, shared experts
        return deepseek_rows(config)
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
                 ((p + "post_attention_layernorm.weight",), q + "post_attention_norm.weight", "copy")]
        kinds = ("weight", "bias") if config.qkv_bias else ("weight",)
        rows += [(tuple(p + f"self_attn.{x}_proj.{kind}" for x in "qkv"), q + f"attention.qkv.{kind}",
                  ("cat", (nq * d, nkv * d, nkv * d))) for kind in kinds]
        kinds = ("weight", "bias") if config.proj_bias else ("weight",)
        rows += [((p + f"self_attn.o_proj.{kind}",), q + f"attention.proj.{kind}", "copy") for kind in kinds]
        if config.qk_layernorm:  # Qwen3: one RMSNorm weight [d] for all query heads, one for all key heads
            rows += [((p + f"self_attn.{x}_norm.weight",), q + f"attention.{x}_norm.weight", "copy") for x in "qk"]
        if config.moe is not None:  # the router here, the experts in _experts_from_hf / _experts_to_hf
            rows.append(((p + "mlp.gate.weight",), q + "mlp.router.weight", "copy"))
            rows += _shared_expert_rows(config, p, q)
            continue
        for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
            rows += [((p + f"mlp.gate_proj.{kind}", p + f"mlp.up_proj.{kind}"), q + f"mlp.fc1.{kind}", ("cat", (f, f))),
                     ((p + f"mlp.down_proj.{kind}",), q + f"mlp.fc2.{kind}", "copy")]
    return rows


def _shared_expert_rows(config: GPTConfig, p: str, q: str) -> list:
    """Qwen2-MoE's gated shared expert: a dense SwiGLU MLP and its sigmoid gate [1, h]."""
    if not config.moe.shared_expert_intermediate_size:
        return []
    f = config.moe.shared_expert_intermediate_size
    return [((p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"),
             q + "mlp.shared_expert.fc1.weight", ("cat", (f, f))),
            ((p + "mlp.shared_expert.down_proj.weight",), q + "mlp.shared_expert.fc2.weight", "copy"),
            ((p + "mlp.shared_expert_gate.weight",), q + "mlp.shared_expert_gate", "copy")]


def _experts_from_hf(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Mixtral's experts (either HF layout) -> megalite's per-expert logical tensors."""
    out = {}
    for layer_id, p, block in block_prefixes(config):  # the model's blocks, then DeepSeek-V3's MTP depths'
        if not config.is_moe_block(layer_id):
            continue
        stacked = p + "mlp.experts.gate_up_proj" in hf_state
        if p + "block_sparse_moe.gate.weight" in hf_state:  # transformers < 5 names the router here
            hf_state[p + "mlp.gate.weight"] = hf_state[p + "block_sparse_moe.gate.weight"]
        for e in range(config.moe.num_experts):
            q = f"{block}mlp.experts.{e}."
            qwen = f"{p}mlp.experts.{e}."  # Qwen-MoE's files: one gate/up/down Linear per expert
            if stacked:
                out[q + "fc1_weight"] = hf_state[p + "mlp.experts.gate_up_proj"][e]
                out[q + "fc2_weight"] = hf_state[p + "mlp.experts.down_proj"][e]
            elif qwen + "gate_proj.weight" in hf_state:
                out[q + "fc1_weight"] = torch.cat([hf_state[qwen + "gate_proj.weight"], hf_state[qwen + "up_proj.weight"]])
                out[q + "fc2_weight"] = hf_state[qwen + "down_proj.weight"]
            else:
                old = f"{p}block_sparse_moe.experts.{e}."
                out[q + "fc1_weight"] = torch.cat([hf_state[old + "w1.weight"], hf_state[old + "w3.weight"]])
                out[q + "fc2_weight"] = hf_state[old + "w2.weight"]
    return out


def _experts_to_hf(full: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """megalite's per-expert tensors -> Mixtral's stacked experts (transformers >= 5 layout)."""
    out = {}
    for layer_id, p, q in block_prefixes(config):
        if not config.is_moe_block(layer_id):
            continue
        experts = range(config.moe.num_experts)
        out[f"{p}mlp.experts.gate_up_proj"] = torch.stack([full[f"{q}mlp.experts.{e}.fc1_weight"] for e in experts])
        out[f"{p}mlp.experts.down_proj"] = torch.stack([full[f"{q}mlp.experts.{e}.fc2_weight"] for e in experts])
    return out


def hf_to_full_state(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> megalite logical full tensors (a config's MTP depths only where the state holds
    them: transformers' DeepSeek-V3 model keeps num_nextn_predict_layers but not the layers)."""
    config = with_mtp_as_present(config, hf_state)
    out: dict[str, torch.Tensor] = _experts_from_hf(dict(hf_state), config) if config.moe is not None else {}
    if config.moe is not None:  # transformers < 5 names the router block_sparse_moe.gate
        hf_state = {k.replace(".block_sparse_moe.gate.", ".mlp.gate."): v for k, v in hf_state.items()}
    out.update((name, hf_state[hf_name]) for hf_name, name in expert_bias_names(config) if hf_name in hf_state)
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
    out.update((hf_name, full[name]) for hf_name, name in expert_bias_names(config) if name in full)
    for hf_names, name, how in _name_table(config):
        if how == "transpose":
            out[hf_names[0]] = full[name].t().contiguous()
        elif how == "copy":
            out[hf_names[0]] = full[name]
        else:
            out.update(zip(hf_names, full[name].split(list(how[1]))))
    if config.tie_embeddings:  # HF keeps the tied head under its own name
        out["lm_head.weight"] = full["word_embeddings.weight"]
    out.update((hf_name, full[name]) for hf_name, name in mtp_shared_copies(config))  # DeepSeek-V3's MTP layers
    return out


def with_mtp_as_present(config: GPTConfig, hf_state: dict[str, torch.Tensor]) -> GPTConfig:
    """`config` without MTP depths when the HF state holds none (transformers' DeepSeek-V3 model and the
    files it saves keep num_nextn_predict_layers but not the layers)."""
    if config.mtp_num_layers and f"model.layers.{config.num_layers}.eh_proj.weight" not in hf_state:
        return config.replace(mtp_num_layers=0)
    return config


def is_mtp_name(hf_name: str, config: GPTConfig) -> bool:
    """A checkpoint tensor of DeepSeek-V3's MTP layers (`model.layers.{L}.*`, L >= num_hidden_layers), which
    transformers' model does not hold."""
    parts = hf_name.split(".")
    return hf_name.startswith("model.layers.") and int(parts[2]) >= config.num_layers


def from_hf(hf_model, mesh=None, *, mtp_state: dict[str, torch.Tensor] | None = None, **model_kwargs):
    """The megalite GPTModel equal to `hf_model`, with this rank's slices of its weights.

    mtp_state: DeepSeek-V3's MTP tensors as its checkpoint files hold them (`model.layers.{L}.*` for L >=
    num_hidden_layers; `hf_mtp_state` writes them), which transformers' model does not load. Given, the
    model has the config's num_nextn_predict_layers depths; without it none, as transformers' model."""
    hf_state = {k: v.detach().to(torch.float32) for k, v in {**hf_model.state_dict(), **(mtp_state or {})}.items()}
    config = with_mtp_as_present(config_from_hf(hf_model.config), hf_state)
    model = GPTModel(config, mesh, **model_kwargs)
    full = hf_to_full_state(hf_state, config)
    model.load_full_state_dict(full)
    load_expert_biases(model, full)  # DeepSeek-V3's correction bias: a buffer
    return model


@torch.no_grad()
def full_state_of(model: GPTModel) -> dict[str, torch.Tensor]:
    """The full logical tensors of a whole model (pp 1, ep 1), each gathered over its tp shards."""
    if not (model.pre_process and model.post_process and len(model.layer_ids) == model.config.num_layers):
        raise ValueError("to_hf needs the whole model on this rank (pp=1); export a pipelined run's checkpoint "
                         "with tools/convert_checkpoint.py export")
    if comm.group_size(model.groups.ep) > 1:
        raise ValueError("to_hf needs every expert on this rank (ep=1); export the run's checkpoint with "
                         "tools/convert_checkpoint.py export")
    full = {}
    for name, param in model.logical_parameters():
        spec = params.shard_spec(param)
        shards = [param.detach().float()]
        if spec.is_tp_sharded:
            gathered = comm.all_gather(shards[0].contiguous(), model.groups.tp, dim=spec.dim)
            shards = list(gathered.chunk(spec.tp_size, dim=spec.dim))  # rank order
        full[name] = spec.assemble(shards)  # vocabulary padding dropped
    biases = dict(model.named_buffers())
    for _, name in expert_bias_names(model.config):  # the same on every rank
        full[name] = biases[name].detach().float()
    return full


def to_hf(model: GPTModel, *, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """The transformers model (float32) equal to megalite's `model` (whole on this rank, any tp)."""
    transformers = require("transformers", "to_hf")  # the [hf] extra
    config = model.config
    hf_config = hf_config_from(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).float()
    state = {k: v for k, v in full_state_to_hf(full_state_of(model), config).items() if not is_mtp_name(k, config)}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (config.tie_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"to_hf: names do not match transformers' {type(hf_model).__name__}: missing {missing[:4]}, "
                       f"unexpected {unexpected[:4]}")
    return hf_model.eval()


def hf_mtp_state(model: GPTModel) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP tensors of `model` (whole on this rank) under its checkpoint's names: what `to_hf`'s
    transformers model cannot hold, and `from_hf(..., mtp_state=)` reads back."""
    config = model.config
    return {k: v for k, v in full_state_to_hf(full_state_of(model), config).items() if is_mtp_name(k, config)}
