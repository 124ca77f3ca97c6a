"""Megatron-core GPT checkpoints in: the legacy per-rank files and torch_dist, read into megalite's full tensors.

    config, full, info = read_megatron(path)     # GPTConfig, {megalite logical name: full tensor}, what was read

`path` is a --save directory (its latest_checkpointed_iteration.txt names the iteration) or one iter_XXXXXXX
(or release) directory. Two formats (docs/megatron.md):

- legacy ("torch"): iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt, one file per tp rank TT (and pp stage
  PPP when pp > 1), each {"args": Namespace, "iteration", "model": this rank's state dict}. A stage numbers its
  layers from 0 (decoder.layers.i is global layer offset + i); tp-split tensors are cut along dim 0
  (linear_qkv, linear_fc1, the embedding and output layer) or dim 1 (linear_proj, linear_fc2).
- torch_dist: a torch.distributed.checkpoint directory (.metadata, *.distcp) beside common.pt ({"args", ...}):
  one global tensor per key, the layers stacked along a leading dim (decoder.layers.mlp.linear_fc1.weight
  [L, 2f, h]), the norms under Transformer Engine's names (linear_qkv.layer_norm_weight) in either spec.

Megatron's layouts and megalite's: linear_qkv holds each query group's [n/g query heads, its key, its value]
rows, group after group (tp ranks hold whole groups), megalite [Q; K; V]; a SwiGLU linear_fc1 holds
[gate; up] per tp rank in the legacy files and [gate; up] whole in torch_dist (its sharded factory), megalite
[gate; up] whole. Megatron's padded vocabulary rows are kept unless `vocab_size` cuts them.

A checkpoint this does not describe (no args, MoE, virtual pipeline stages, a GeLU or position scheme megalite
lacks, a missing or misshapen tensor) raises MegatronCheckpointError (a UsageError): one line naming it.
"""
from __future__ import annotations

import re
import warnings
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalite.config.model import GPTConfig
from megalite.errors import UsageError
from megalite.parameters import params


class MegatronCheckpointError(UsageError):
    """A Megatron checkpoint that cannot be read as a megalite GPT (the message names why)."""


@dataclass(frozen=True)
class MegatronInfo:
    """What was read: the format ("legacy" or "torch_dist"), the iteration and the source layout."""

    format: str
    iteration: int | str
    tp: int
    pp: int


_ITER = re.compile(r"^(iter_\d{7}|release)$")
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def iteration_dir(path: str | Path) -> Path:
    """The iteration directory `path` names: itself, or the one its latest_checkpointed_iteration.txt names."""
    path = Path(path)
    if not path.is_dir():
        raise MegatronCheckpointError(f"--load {path}: not a directory; pass a Megatron --save directory or one "
                                      f"of its iter_XXXXXXX directories")
    if _ITER.match(path.name):
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        raise MegatronCheckpointError(f"--load {path}: no latest_checkpointed_iteration.txt and not an iter_XXXXXXX "
                                      f"directory; pass a Megatron checkpoint")
    text = tracker.read_text().strip()
    name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else None)
    if name is None or not (path / name).is_dir():
        raise MegatronCheckpointError(f"--load {path}: latest_checkpointed_iteration.txt says {text!r}, which names "
                                      f"no iteration directory here")
    return path / name


def _torch_load(path: Path) -> dict:
    """A Megatron file: pickled (args is an argparse Namespace), so read as the trusted checkpoint it is."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: its one line
        raise MegatronCheckpointError(f"{path}: not readable as a torch file ({type(exc).__name__}: {exc})") from None
    if not isinstance(loaded, dict):
        raise MegatronCheckpointError(f"{path}: holds a {type(loaded).__name__}, not Megatron's checkpoint dict")
    return loaded


def _args(loaded: dict, where: Path) -> Namespace:
    args = loaded.get("args")
    if not isinstance(args, Namespace):
        raise MegatronCheckpointError(f"{where}: holds no Megatron args (saved without --use-checkpoint-args' "
                                      f"'args'); the model's shape cannot be known")
    return args


def config_from_args(args: Namespace, vocab_size: int | None = None) -> GPTConfig:
    """The megalite GPTConfig of a Megatron GPT's arguments (refused in one line where megalite differs)."""
    def get(name, default=None):
        return getattr(args, name, default)

    if get("num_experts"):
        raise MegatronCheckpointError(f"a mixture-of-experts checkpoint ({get('num_experts')} experts): import of "
                                      f"Megatron's MoE layers is not built; convert its experts through HF instead")
    if (get("rotary_percent") or 1.0) != 1.0 or get("use_rope_scaling"):
        raise MegatronCheckpointError("rotary_percent < 1 or --use-rope-scaling: megalite's RoPE turns every "
                                      "dimension with plain frequencies")
    swiglu, rope = bool(get("swiglu")), get("position_embedding_type", "learned_absolute") == "rope"
    rms = get("normalization", "LayerNorm") == "RMSNorm"
    if (swiglu, rope, rms) == (True, True, True):
        flavour = "llama"
    elif (swiglu, rope, rms) == (False, False, False) and get("openai_gelu"):
        flavour = "gpt2"
    else:
        raise MegatronCheckpointError(
            f"swiglu={swiglu}, position_embedding_type={get('position_embedding_type')}, normalization="
            f"{get('normalization')}, openai_gelu={get('openai_gelu')}: megalite builds Llama's (SwiGLU, RoPE, "
            f"RMSNorm) or GPT-2's (tanh GeLU --openai-gelu, learned positions, LayerNorm)")
    padded = get("padded_vocab_size")
    if vocab_size is not None and padded is not None and not 0 < vocab_size <= padded:
        raise MegatronCheckpointError(f"--vocab-size {vocab_size}: the checkpoint's embedding has {padded} rows; "
                                      f"pass 1..{padded}")
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else heads
    hidden = get("hidden_size")
    kv = get("kv_channels")
    return GPTConfig(
        flavour=flavour, num_layers=get("num_layers"), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=get("ffn_hidden_size"), vocab_size=vocab_size or padded,
        seq_length=get("max_position_embeddings") if flavour == "gpt2" else get("seq_length"),
        norm_eps=get("norm_epsilon", 1e-5), rope_theta=float(get("rotary_base", 10000)),
        tie_embeddings=not get("untie_embeddings_and_output_weights", False),
        add_bias=bool(get("add_bias_linear", True)), qkv_bias=bool(get("add_qkv_bias", False) or
                                                                    get("add_bias_linear", True)),
        kv_channels=kv if kv and kv != hidden // heads else None, qk_layernorm=bool(get("qk_layernorm", False)))


# A block's tensors: (Megatron's names after decoder.layers.{i}. -- the local spec's, then Transformer Engine's,
# which torch_dist uses in either spec --, megalite's name after layers.{i}., the legacy files' tp-split dim).
_LAYER = [
    (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), "input_norm.weight", None),
    (("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"), "input_norm.bias", None),
    (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), "post_attention_norm.weight", None),
    (("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"), "post_attention_norm.bias", None),
    (("self_attention.linear_qkv.weight",), "attention.qkv.weight", 0),
    (("self_attention.linear_qkv.bias",), "attention.qkv.bias", 0),
    (("self_attention.q_layernorm.weight",), "attention.q_norm.weight", None),
    (("self_attention.k_layernorm.weight",), "attention.k_norm.weight", None),
    (("self_attention.linear_proj.weight",), "attention.proj.weight", 1),
    (("self_attention.linear_proj.bias",), "attention.proj.bias", None),
    (("mlp.linear_fc1.weight",), "mlp.fc1.weight", 0),
    (("mlp.linear_fc1.bias",), "mlp.fc1.bias", 0),
    (("mlp.linear_fc2.weight",), "mlp.fc2.weight", 1),
    (("mlp.linear_fc2.bias",), "mlp.fc2.bias", None),
]
# The model's other tensors: (Megatron's name, megalite's, the legacy files' tp-split dim).
_GLOBAL = [
    ("embedding.word_embeddings.weight", "word_embeddings.weight", 0),
    ("embedding.position_embeddings.weight", "position_embeddings", None),
    ("decoder.final_layernorm.weight", "final_norm.weight", None),
    ("decoder.final_layernorm.bias", "final_norm.bias", None),
    ("output_layer.weight", "output_weight", 0),
]
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _qkv_to_megalite(t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Megatron's [g * (n/g + 2) * d, ...] (each group's queries, key, value) -> megalite's [Q; K; V]."""
    n, g, d = config.num_attention_heads, config.num_query_groups or config.num_attention_heads, config.head_dim
    per_group = t.reshape(g, n // g + 2, d, *t.shape[1:])
    rest = tuple(t.shape[1:])
    return torch.cat([per_group[:, :n // g].reshape(n * d, *rest), per_group[:, n // g].reshape(g * d, *rest),
                      per_group[:, n // g + 1].reshape(g * d, *rest)])


def _to_megalite(name: str, t: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """A whole Megatron tensor (fc1 already [gate; up]) in megalite's layout: qkv reordered, vocab rows cut."""
    if name.endswith("attention.qkv.weight") or name.endswith("attention.qkv.bias"):
        return _qkv_to_megalite(t, config)
    if name in ("word_embeddings.weight", "output_weight"):
        return t[:config.vocab_size]
    return t


def _check_complete(full: dict, config: GPTConfig, unknown: list[str], where: Path) -> dict:
    """`full` against the megalite model's own logical tensors: every one present with its shape, none left over."""
    from megalite.model.gpt import GPTModel  # the model package sits above checkpoint/: imported where needed

    if unknown:
        raise MegatronCheckpointError(f"{where}: {unknown[0]} is not a tensor of the GPT megalite builds from its "
                                      f"args ({len(unknown)} such)")
    expected = {name: tuple(params.shard_spec(p).full_shape)
                for name, p in GPTModel(config, device="meta").logical_parameters()}
    for name, shape in expected.items():
        if name not in full:
            raise MegatronCheckpointError(f"{where}: no tensor for megalite's {name} (the args describe it)")
        if tuple(full[name].shape) != shape:
            raise MegatronCheckpointError(f"{where}: {name} has shape {tuple(full[name].shape)}, the args say {shape}")
    return {name: full[name].float().contiguous() for name in expected}


def _legacy_files(directory: Path) -> dict[tuple[int, int], Path]:
    """{(tp rank, pp rank): model_optim_rng.pt} of a legacy iteration directory, the grid checked whole."""
    files = {}
    for sub in sorted(directory.iterdir()):
        match = _RANK.match(sub.name)
        if match and (sub / "model_optim_rng.pt").is_file():
            files[int(match.group(1)), int(match.group(2) or 0)] = sub / "model_optim_rng.pt"
    tp, pp = (max(k[i] for k in files) + 1 if files else 0 for i in (0, 1))
    if not files or len(files) != tp * pp:
        raise MegatronCheckpointError(f"{directory}: expected mp_rank_TT[_PPP]/model_optim_rng.pt for every tp and "
                                      f"pp rank, found {len(files)} (tp {tp} x pp {pp} needs {tp * pp})")
    return files


def _merge_tp(suffix: str, shards: list[torch.Tensor], dim: int | None, swiglu: bool) -> torch.Tensor:
    """One tensor's tp shards (rank order) -> the whole Megatron tensor; a SwiGLU fc1 -> [gate; up]."""
    if dim is None or len(shards) == 1 and not swiglu:
        return shards[0]
    if swiglu and suffix.startswith("mlp.linear_fc1."):  # each rank's [gate_r; up_r]
        halves = [shard.chunk(2) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def _read_legacy(directory: Path, vocab_size: int | None):
    files = _legacy_files(directory)
    tp, pp = max(k[0] for k in files) + 1, max(k[1] for k in files) + 1
    loaded = {key: _torch_load(path) for key, path in files.items()}
    first = loaded[0, 0]
    if "model" not in first:
        where = "model0 (virtual pipeline stages)" if "model0" in first else f"keys {sorted(first)[:4]}"
        raise MegatronCheckpointError(f"{files[0, 0]}: no 'model' state dict ({where}); virtual pipeline "
                                      f"checkpoints are not read")
    args = _args(first, files[0, 0])
    config = config_from_args(args, vocab_size)
    layer_names = {suffix: (name, dim) for suffixes, name, dim in _LAYER for suffix in suffixes}
    global_names = {key: (name, dim) for key, name, dim in _GLOBAL}
    full, unknown, offset = {}, [], 0
    for stage in range(pp):
        states = [loaded[rank, stage]["model"] for rank in range(tp)]
        keys = [k for k in states[0] if not k.endswith("_extra_state")]
        local_layers = 0
        for key in keys:
            shards = [state[key] for state in states]
            match = _LAYER_KEY.match(key)
            if match and match.group(2) in layer_names:
                index, suffix = int(match.group(1)), match.group(2)
                name, dim = layer_names[suffix]
                local_layers = max(local_layers, index + 1)
                name = f"layers.{offset + index}.{name}"
                full[name] = _to_megalite(name, _merge_tp(suffix, shards, dim, config.flavour == "llama"), config)
            elif key in global_names:
                name, dim = global_names[key]
                full[name] = _to_megalite(name, _merge_tp(key, shards, dim, False), config)
            else:
                unknown.append(key)
        offset += local_layers
    if offset != config.num_layers:
        raise MegatronCheckpointError(f"{directory}: the stages hold {offset} layers, the args say {config.num_layers}")
    return config, _check_complete(full, config, unknown, directory), MegatronInfo(
        "legacy", first.get("iteration", "?"), tp, pp)


def _read_torch_dist(directory: Path, vocab_size: int | None):
    common = directory / "common.pt"
    if not common.is_file():
        raise MegatronCheckpointError(f"{directory}: a torch_dist checkpoint without common.pt (its args)")
    loaded = _torch_load(common)
    config = config_from_args(_args(loaded, common), vocab_size)
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged .metadata: its one line
        raise MegatronCheckpointError(f"{directory}: torch.distributed.checkpoint cannot read its metadata "
                                      f"({type(exc).__name__}: {exc})") from None
    tensors = {key: entry for key, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, TensorStorageMetadata) and not key.startswith("optimizer.")}
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in tensors.items()}
    with warnings.catch_warnings():  # one process reading, as meant (torch warns that it assumes so)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    torch_dist_names = {"decoder.layers." + suffixes[-1]: name for suffixes, name, _ in _LAYER}
    global_names = {key: name for key, name, _ in _GLOBAL}
    full, unknown = {}, []
    for key, tensor in state.items():
        if key in torch_dist_names:  # [L, ...]: the layers stacked
            if tensor.shape[0] != config.num_layers:
                raise MegatronCheckpointError(f"{directory}: {key} stacks {tensor.shape[0]} layers, the args say "
                                              f"{config.num_layers}")
            for layer in range(config.num_layers):
                name = f"layers.{layer}.{torch_dist_names[key]}"
                full[name] = _to_megalite(name, tensor[layer], config)
        elif key in global_names:
            full[global_names[key]] = _to_megalite(global_names[key], tensor, config)
        else:
            unknown.append(key)
    return config, _check_complete(full, config, unknown, directory), MegatronInfo(
        "torch_dist", loaded.get("iteration", "?"), getattr(loaded["args"], "tensor_model_parallel_size", 1),
        getattr(loaded["args"], "pipeline_model_parallel_size", 1))


def read_megatron(path: str | Path, *, vocab_size: int | None = None) -> tuple[GPTConfig, dict, MegatronInfo]:
    """(GPTConfig, {megalite logical name: full fp32 tensor}, MegatronInfo) of a Megatron-core GPT checkpoint in
    either format; vocab_size: keep the embedding's first rows only (default: Megatron's padded vocabulary)."""
    directory = iteration_dir(path)
    if (directory / ".metadata").is_file():
        return _read_torch_dist(directory, vocab_size)
    if any(_RANK.match(sub.name) for sub in directory.iterdir()):
        return _read_legacy(directory, vocab_size)
    raise MegatronCheckpointError(f"{directory}: neither torch_dist (.metadata) nor legacy (mp_rank_*/"
                                  f"model_optim_rng.pt) files; pass a Megatron-core checkpoint")
