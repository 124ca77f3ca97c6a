"""megalite checkpoints to and from torch's formats: torch.distributed.checkpoint (DCP) and safetensors.

    python tools/convert_checkpoint.py --to dcp --load runs/ckpt [--step N] --output runs/ckpt_dcp
    python tools/convert_checkpoint.py --to safetensors --load runs/ckpt --output model.safetensors
    python tools/convert_checkpoint.py --from dcp --load runs/ckpt_dcp --output runs/ckpt_back

A megalite checkpoint saved at any layout holds layout-free boxes of full tensors; these read them
whole (every file verified) and write one plain, unsharded state dict:

    {"model": {logical name: tensor (saved dtype)},
     "optimizer": {"state": {logical name: {"master", "exp_avg", "exp_avg_sq": fp32 tensors}},
                   "step": int},                            # only when the checkpoint has optimizer state
     "megalite": {"metadata": JSON text}}                   # model_config, layout, step, consumed samples

A DCP directory of it loads with torch's `dcp.load` into a dict of that shape (tensors of those
shapes, on any world: DCP reshards itself), e.g. `dcp.load({"model": {name: torch.empty(shape)}},
checkpoint_id=dir)`. safetensors holds the "model" part only (its format has no nesting). `--from
dcp` reads such a directory (the "model" part is required; "optimizer" is kept when present) into
a megalite checkpoint any layout can load, at the step and consumed samples stored in it.
"""
from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalite.checkpoint.boxes import whole_box
from megalite.checkpoint.full_state import resolve_checkpoint_dir, write_one_process_checkpoint
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.snapshot import OPTIMIZER_KINDS, Item
from megalite.extras import require


@contextlib.contextmanager
def _one_process():
    """DCP in this one process (no process group): torch warns that it assumes so; it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_plain_state(path: str | Path, step: int | None = None, progress=None) -> dict:
    """The plain state dict (module docstring) of a megalite checkpoint saved at any layout.
    `progress`: a megalite.progress.ProgressBar counting the bytes read (its total set here) and tensors."""
    reader = CheckpointReader(resolve_checkpoint_dir(path, step))
    meta = reader.metadata
    shapes = {name: tuple(shape) for name, shape in meta["tensors"].items()}
    reads = [("model", name, shape, None) for name, shape in shapes.items()]
    if meta["has_optimizer"]:
        reads += [(kind, name, shape, torch.float32) for name, shape in shapes.items() if reader.has("exp_avg", name)
                  for kind in OPTIMIZER_KINDS]
    if progress is not None:
        progress.total = sum(math.prod(shape) * (dtype or reader.items[(kind, name)][0][1]).itemsize
                             for kind, name, shape, dtype in reads)
    read = {}
    for kind, name, shape, dtype in reads:
        read[kind, name] = reader.read_full(kind, name, shape, dtype).clone()
        if progress is not None:
            progress.update(read[kind, name].numel() * read[kind, name].element_size(), 1)
    if progress is not None:
        progress.update(0, final=True)
    state = {"model": {name: read["model", name] for name in shapes}}
    if meta["has_optimizer"]:
        state["optimizer"] = {"step": int(meta["optimizer_step"]), "state": {
            name: {kind: read[kind, name] for kind in OPTIMIZER_KINDS}
            for name in shapes if ("exp_avg", name) in read}}
    reader.close()
    kept = {k: v for k, v in meta.items() if k not in ("items", "tensors")}
    state["megalite"] = {"metadata": json.dumps(kept, sort_keys=True)}
    return state


def export_dcp(load: str | Path, output: str | Path, *, step: int | None = None, progress=None) -> Path:
    """Write the checkpoint as a DCP directory (one process, no process group needed); `progress`: a
    ProgressBar while the checkpoint is read."""
    state = read_plain_state(load, step, progress)
    with _one_process():
        dcp.save(state, checkpoint_id=str(output), no_dist=True)
    return Path(output)


def export_safetensors(load: str | Path, output: str | Path, *, step: int | None = None, progress=None) -> Path:
    """Write the checkpoint's weights (logical names, saved dtype) as one safetensors file; `progress`: a
    ProgressBar while the checkpoint is read."""
    save_file = require("safetensors.torch", "--to safetensors").save_file  # the [hf] extra
    state = read_plain_state(load, step, progress)
    meta = json.loads(state["megalite"]["metadata"])
    save_file({name: t.contiguous() for name, t in state["model"].items()}, str(output),
              metadata={"format": "pt", "megalite_step": str(meta["step"])})
    return Path(output)


def _empty_like_dcp(path: str | Path) -> dict:
    """A nested dict of empty tensors (and placeholders for objects) shaped as the DCP directory's own."""
    metadata = FileSystemReader(str(path)).read_metadata()
    nested: dict = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        keys = metadata.planner_data.get(fqn, (fqn,)) if metadata.planner_data else (fqn,)
        node = nested
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if isinstance(entry, TensorStorageMetadata):
            node[keys[-1]] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        else:
            node[keys[-1]] = None  # an object (text, int): DCP fills it in
    return nested


def _write_checkpoint(output: str | Path, model: dict, optimizer: dict | None, meta: dict) -> Path:
    """Publish `model` (and `optimizer`'s state) as a megalite checkpoint, one box per tensor."""
    items = [Item("model", name, whole_box(tuple(t.shape)), t.detach().cpu().contiguous()) for name, t in model.items()]
    for name, entry in (optimizer or {}).get("state", {}).items():
        items += [Item(kind, name, whole_box(tuple(entry[kind].shape)), entry[kind].float().contiguous())
                  for kind in OPTIMIZER_KINDS]
    fields = {"consumed_samples": int(meta.get("consumed_samples", 0)),
              "optimizer_step": int(optimizer["step"]) if optimizer else 0,
              "loss_scaler": meta.get("loss_scaler") if optimizer else None, "has_optimizer": optimizer is not None,
              "model_config": meta.get("model_config"), "train_config": meta.get("train_config"),
              "extra": meta.get("extra") or {}}
    return write_one_process_checkpoint(output, int(meta.get("step", 0)), items,
                                        {name: list(t.shape) for name, t in model.items()}, fields)


def import_dcp(load: str | Path, output: str | Path) -> Path:
    """A DCP directory holding {"model": {...}} (+ "optimizer", "megalite") -> a megalite checkpoint."""
    state = _empty_like_dcp(load)
    if not isinstance(state.get("model"), dict) or not state["model"]:
        raise ValueError(f"{load} holds no 'model' state dict; save {{'model': model.state_dict()}} with dcp.save")
    with _one_process():
        dcp.load(state, checkpoint_id=str(load), no_dist=True)
    meta = json.loads(state["megalite"]["metadata"]) if isinstance(state.get("megalite"), dict) else {}
    optimizer = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else None
    if optimizer is not None:
        bad = [n for n, e in optimizer.get("state", {}).items() if set(e) != set(OPTIMIZER_KINDS)]
        if bad or "step" not in optimizer:
            raise ValueError(f"{load}'s optimizer part is not megalite's ({bad[:1] or 'no step'}): each parameter "
                             f"needs {', '.join(OPTIMIZER_KINDS)} and a step; drop 'optimizer' to import weights only")
    return _write_checkpoint(output, state["model"], optimizer, meta)
