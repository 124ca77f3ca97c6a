"""The model to sample from: a megalite checkpoint (any layout) or a transformers directory.

    loaded = load_for_generation(mesh, load="runs/ckpt")      # or hf="./Qwen3-0.6B"
    loaded.model, loaded.eos_token_id, loaded.tokenizer_path

A checkpoint's full tensors are read (verified) on every rank and each rank keeps its tp slices
(GPTModel.load_full_state_dict), so a checkpoint saved at any (tp, pp, dp, zero) samples at any tp.
A transformers directory is read with `from_pretrained` (local files only) and imported by from_hf;
its tokenizer.json, when present, is the default tokenizer. The end-of-sequence id is the HF config's,
an imported checkpoint's own, else the tokenizer's end-of-document id.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.checkpoint import read_full_state
from megalite.errors import UsageError
from megalite.extras import require
from megalite.distributed.mesh import Mesh
from megalite.model.gpt import GPTModel
from megalite.model.hf import from_hf


@dataclass
class LoadedModel:
    model: GPTModel
    eos_token_id: int | None  # None: the tokenizer's end-of-document id
    tokenizer_path: str | None  # a tokenizer.json found beside an HF model


def _first_id(value) -> int | None:
    """An HF eos id (an int, a list of them, or None) -> the first one."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _from_checkpoint(mesh: Mesh, load: str, step: int | None, dtype: torch.dtype) -> LoadedModel:
    try:
        config, full, meta = read_full_state(load, step)
    except FileNotFoundError as exc:
        raise UsageError(f"--load {load}: {exc}; pass a run's --save directory or one step_* directory") from None
    model = GPTModel(config, mesh, dtype=dtype)
    model.load_full_state_dict(full)
    ids = (meta.get("extra") or {}).get("special_token_ids") or {}
    return LoadedModel(model, _first_id(ids.get("eos")), None)


def _from_hf(mesh: Mesh, directory: str, dtype: torch.dtype) -> LoadedModel:
    transformers = require("transformers", "generate.py --hf")  # the [hf] extra
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise UsageError(f"--hf {directory}: no config.json; pass a directory written by save_pretrained")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    try:
        model = from_hf(hf, mesh, dtype=dtype)
    except ValueError as exc:  # a family or feature megalite does not convert: one line
        raise UsageError(f"--hf {directory}: {exc}") from None
    eos = _first_id(getattr(hf.generation_config, "eos_token_id", None) or hf.config.eos_token_id)
    tokenizer = path / "tokenizer.json"
    return LoadedModel(model, eos, str(tokenizer) if tokenizer.is_file() else None)


def load_for_generation(mesh: Mesh, *, load: str | None = None, hf: str | None = None, step: int | None = None,
                        dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model of `load` (a megalite checkpoint) or `hf` (a transformers directory), this rank's slices."""
    if mesh.pp_size > 1:
        raise UsageError("generation runs the whole model on each tp group (pp 1); launch it with --pp 1 (any "
                         "checkpoint loads at any layout)")
    loaded = _from_checkpoint(mesh, load, step, dtype) if load is not None else _from_hf(mesh, hf, dtype)
    return loaded
