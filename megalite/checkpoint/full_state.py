"""Whole (unsharded) tensors in and out of a checkpoint, without any process group.

For conversion tools (tools/convert_checkpoint.py): `read_full_state` assembles every full
logical tensor of a checkpoint saved at any layout; `write_full_state` publishes a checkpoint
holding only model weights (no optimizer state: a run that loads it starts its optimizer
from those weights, step 0, no samples consumed), in the same format and with the same
atomic protocol as a training run's.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megalite.checkpoint import storage
from megalite.checkpoint.boxes import whole_box
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.save import FORMAT_VERSION, _jsonable
from megalite.checkpoint.snapshot import Item
from megalite.config.model import GPTConfig


def resolve_checkpoint_dir(path: str | Path, step: int | None = None) -> Path:
    """A step directory as given, or the one `latest` (or `step`) names inside a save directory."""
    path = Path(path)
    if (path / storage.MANIFEST).exists():
        return path
    if step is None:
        step = storage.latest_step(path)
        if step is None:
            steps = storage.complete_steps(path)
            if not steps:
                raise FileNotFoundError(f"{path} holds no megalite checkpoint (no {storage.LATEST}, no step_* with a "
                                        f"{storage.MANIFEST})")
            step = steps[-1]
    found = path / storage.step_dir_name(step)
    if not (found / storage.MANIFEST).exists():
        raise FileNotFoundError(f"{found} is not a complete megalite checkpoint")
    return found


EXPERT_BIAS = "expert_bias"  # the item kind of a router's expert bias (checkpoint/load.py reads it so too)


def read_full_state(path: str | Path, step: int | None = None,
                    progress=None) -> tuple[GPTConfig, dict[str, torch.Tensor], dict]:
    """(model config, {logical name: full tensor in the saved dtype}, metadata); every file read is verified.
    `progress`: a megalite.progress.ProgressBar counting bytes (its total set here) and tensors."""
    reader = CheckpointReader(resolve_checkpoint_dir(path, step))
    meta = reader.metadata
    config = GPTConfig(**meta["model_config"])
    if progress is not None:
        progress.total = sum(math.prod(shape) * reader.items[("model", name)][0][1].itemsize
                             for name, shape in meta["tensors"].items())
    full = {}
    for name, shape in meta["tensors"].items():
        full[name] = reader.read_full("model", name, tuple(shape)).clone()
        if progress is not None:
            progress.update(full[name].numel() * full[name].element_size(), 1)
    for (kind, name), entries in list(reader.items.items()):  # DeepSeek-V3's correction biases (buffers)
        if kind == EXPERT_BIAS:
            full[name] = reader.read_full(kind, name, tuple(hi - lo for lo, hi in entries[0][0])).clone()
    if progress is not None:
        progress.update(0, final=True)
    reader.close()
    return config, full, meta


def write_full_state(save_dir: str | Path, config: GPTConfig, full: dict[str, torch.Tensor], *, step: int = 0,
                     extra: dict | None = None) -> Path:
    """Publish `full` (logical names, unpadded) as checkpoint `step` of `save_dir`; returns its path."""
    kind_of = {name: EXPERT_BIAS if name.endswith("." + EXPERT_BIAS) else "model" for name in full}
    items = [Item(kind_of[name], name, whole_box(tuple(t.shape)), t.detach().cpu().contiguous())
             for name, t in full.items()]
    fields = {"consumed_samples": 0, "optimizer_step": 0, "loss_scaler": None, "has_optimizer": False,
              "model_config": _jsonable(config), "train_config": None, "extra": _jsonable(extra or {})}
    shapes = {name: list(t.shape) for name, t in full.items() if kind_of[name] == "model"}
    return write_one_process_checkpoint(save_dir, step, items, shapes, fields)


def write_one_process_checkpoint(save_dir: str | Path, step: int, items: list[Item], shapes: dict[str, list[int]],
                                 fields: dict) -> Path:
    """Publish whole-tensor `items` as checkpoint `step` of `save_dir`: one shard, the layout of one
    process, `fields` (counters, configs, extra) in its metadata. Written atomically, with checksums."""
    tmp = storage.prepare_tmp_dir(Path(save_dir), step)
    file = storage.shard_file_name(0)
    rows, offset = [], 0
    for item in items:
        rows.append(item.index_entry(file, offset))
        offset += item.tensor.numel() * item.tensor.element_size()
    files = {file: storage.write_shard(tmp / file, [item.tensor for item in items])}
    rows, files = storage.attach_crcs(rows, files)
    dtype = storage.DTYPE_NAMES[items[0].tensor.dtype] if items else "float32"
    metadata = {"format_version": FORMAT_VERSION, "step": step, **fields,
                "layout": {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "virtual_stages": 1, "zero_stage": None,
                           "param_dtype": dtype},
                "versions": {"torch": torch.__version__}, "tensors": shapes, "items": rows}
    sha = storage.write_json_atomic(tmp / storage.METADATA, metadata)
    files[storage.METADATA] = {"sha256": sha, "bytes": len(json.dumps(metadata, indent=1, sort_keys=True).encode())}
    return storage.publish(tmp, files)
