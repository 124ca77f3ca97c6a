"""The model's shape from the checkpoint --load names (Megatron-LM's --use-checkpoint-args, always on).

    cfg, notes = adopt_checkpoint_model(cfg, given_settings(argv))   # every rank, before any process group

A checkpoint holds the GPTConfig of the model that wrote it (metadata["model_config"]; an HF import's
too). Whenever --load names a checkpoint, that is the model: the run needs no shape flag, so continuing
an imported Qwen3 at tp 2 is `--load DIR --tp 2`. A shape flag that is given anyway must agree with it;
one that contradicts it is refused in one line naming both values (the load would fail later, after the
process groups, as "saved from another model"). What is not the model's shape stays the flags': the
dropouts, --seq-length (except GPT-2's, whose position table has that many rows) and the MoE training
settings (balancing losses, capacity, expert bias).

The model travels in RunConfig.checkpoint_model (the GPTConfig as JSON, read by RunConfig.gpt_config);
for a training run's checkpoint the model settings its run was given are also copied where this command
line does not set them, so a resume compares settings as before (checkpoint/resume_settings.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from megalite.checkpoint.elastic import find_checkpoint
from megalite.config import RunConfig, settings
from megalite.config.model import GPTConfig
from megalite.errors import ConfigError


def _moe(field: str) -> Callable[[GPTConfig], Any]:
    return lambda c: None if c.moe is None else getattr(c.moe, field)


# A shape setting -> what it decides in the model (compared between the flags' model and the checkpoint's)
_FIELD = {name: (lambda c, n=name: getattr(c, n)) for name in
          ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
           "qk_layernorm", "make_vocab_size_divisible_by")}
SHAPE: dict[str, dict[str, Callable[[GPTConfig], Any]]] = {
    **{name: {name: getter} for name, getter in _FIELD.items()},
    "group_query_attention": {"num_query_groups": _FIELD["num_query_groups"]},
    "kv_channels": {"head_dim": lambda c: c.head_dim},
    "position_embedding_type": {"flavour": lambda c: c.flavour},
    "normalization": {"flavour": lambda c: c.flavour},
    "swiglu": {"flavour": lambda c: c.flavour},
    "untie_embeddings_and_output_weights": {"tie_embeddings": lambda c: c.tie_embeddings},
    "disable_bias_linear": {"add_bias": lambda c: c.add_bias},
    "add_qkv_bias": {"qkv_bias": lambda c: c.qkv_bias},
    "norm_epsilon": {"norm_eps": lambda c: c.norm_eps},
    "rotary_base": {"rope_theta": lambda c: c.rope_theta},
    "num_experts": {"num_experts": _moe("num_experts")},
    "moe_router_topk": {"topk": _moe("topk")},
    "moe_ffn_hidden_size": {"moe_ffn_hidden_size": lambda c: None if c.moe is None else c.moe.expert_ffn(
        c.ffn_hidden_size)},
    "moe_layer_freq": {"moe_layer_freq": _moe("layer_freq")},
    "moe_router_score_function": {"score_function": _moe("score_function")},
    "moe_router_pre_softmax": {"pre_softmax": _moe("pre_softmax")},
    "moe_shared_expert_intermediate_size": {"shared_expert_intermediate_size": _moe("shared_expert_intermediate_size")},
}
# --model names a whole preset: every field that decides the parameters and what they compute
_PRESET_FIELDS = ("flavour", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                  "vocab_size", "tie_embeddings", "qkv_bias", "proj_bias", "mlp_bias", "head_dim", "qk_layernorm",
                  "norm_eps", "rope_theta", "rope_scaling")
SHAPE["model"] = {name: (lambda c, n=name: getattr(c, n)) for name in _PRESET_FIELDS}
SHAPE["model"]["num_experts"] = _moe("num_experts")
# the model's own settings a run may change: taken from the flags, never compared
NOT_SHAPE = ("seq_length", "hidden_dropout", "attention_dropout", "init_method_std", "max_position_embeddings")


def _contradictions(flags_model: GPTConfig, saved: GPTConfig, given: frozenset[str]) -> list[str]:
    """'--hidden-size 64 (the flags: hidden_size 64, the checkpoint's 128)' for each given shape setting
    whose model differs from the checkpoint's."""
    out = []
    declared = settings()
    for name in [n for n in declared if n in given and n in SHAPE]:
        differ = [(field, get(flags_model), get(saved)) for field, get in SHAPE[name].items()
                  if get(flags_model) != get(saved)]
        if differ:
            what = ", ".join(f"{field} {mine} vs the checkpoint's {theirs}" for field, mine, theirs in differ)
            out.append(f"{declared[name].flag} ({what})")
    if "seq_length" in given and saved.flavour == "gpt2" and flags_model.seq_length != saved.seq_length:
        out.append(f"--seq-length (seq_length {flags_model.seq_length} vs the checkpoint's {saved.seq_length}: GPT-2's "
                   f"position table has that many rows)")
    return out


def _flags_model(cfg: RunConfig, saved: GPTConfig, given: frozenset[str]) -> GPTConfig:
    """The model the flags describe: the preset with the flags; where that is no model (a flag fits the
    checkpoint's shape, not the preset's), the checkpoint's with the given plainly named fields over it;
    where that is none either, the given fields over a config that is not checked (they differ anyway)."""
    try:
        return cfg.gpt_config()
    except ValueError:
        pass
    direct = {name: getattr(cfg.model, name) for name in _FIELD if name in given}
    try:
        return saved.replace(**direct)
    except ValueError:
        unchecked = dataclasses.replace(saved)  # a copy, its fields then set without __post_init__'s checks
        for name, value in direct.items():
            setattr(unchecked, name, value)
        return unchecked


def _saved_model_settings(metadata: dict, given: frozenset[str]) -> dict[str, Any]:
    """The model and MoE settings of the checkpoint's run that this command line leaves unset."""
    train = metadata.get("train_config")
    if not isinstance(train, dict):
        return {}
    declared = settings()
    return {name: value for part in ("model", "moe") for name, value in (train.get(part) or {}).items()
            if name in declared and declared[name].part == part and name not in given}


def adopt_checkpoint_model(cfg: RunConfig, given: frozenset[str]) -> tuple[RunConfig, list[str]]:
    """`cfg` whose model is the one --load's checkpoint holds, and the note for rank 0's log; `cfg`
    unchanged when --load names no checkpoint (yet) or one without a model config, or when a resume's
    shape flags contradict it (the resume's settings check reports that, the model first, with every other
    difference). Under --finetune, ConfigError (one line) naming each shape flag that contradicts it."""
    ck = cfg.checkpoint
    if not ck.load:
        return cfg, []
    found = find_checkpoint(ck.load, ck.load_step)
    if found is None and os.path.isfile(os.path.join(ck.load, "config.json")):  # else: trained from scratch
        raise ConfigError(f"--load {ck.load} is a transformers directory, not a megalite checkpoint; import it once "
                          f"with tools/convert_checkpoint.py import --hf {ck.load} --output CKPT, then --load CKPT")
    if found is None or not isinstance(found[1].get("model_config"), dict):
        return cfg, []
    step, metadata = found
    try:
        saved = GPTConfig(**metadata["model_config"])
    except (TypeError, ValueError):  # a user's own model's config (training/provided.py): the load names it
        return cfg, []
    problems = _contradictions(_flags_model(cfg, saved, given), saved, given)
    if problems and not ck.finetune:  # a resume: the settings check names the other model first, with every
        return cfg, []                # other refused difference at once (checkpoint/resume_settings.py)
    if problems:
        raise ConfigError(f"--load {ck.load} (step {step}) holds the model its checkpoint was saved from, and "
                          f"{'; '.join(problems)} contradicts it: drop the shape flags (the model comes from the "
                          f"checkpoint) or point --load at the model you mean")
    cfg = cfg.replace(**_saved_model_settings(metadata, given))
    cfg = cfg.with_checkpoint_model(json.dumps(metadata["model_config"], sort_keys=True))
    model = cfg.gpt_config()
    return cfg, [f"megalite: the model is checkpoint step {step}'s: {model.flavour}, {model.num_layers} layers, hidden "
                 f"{model.hidden_size}, {model.num_attention_heads} heads, vocabulary {model.vocab_size} "
                 f"({model.num_params() / 1e6:.2f}M parameters)"]
