"""What one rank contributes to a checkpoint: boxes of full tensors, copied to CPU memory.

Kinds of stored tensors, each keyed by (kind, logical name, box of the full tensor):
- "model": the parameter (its dtype), written by dp rank 0 only (the dp replicas are equal),
  and for a parameter every tp rank holds whole (norms, biases after a row-parallel layer,
  position embeddings) by tp rank 0 only; at ZeRO-3 every dp rank writes the flat pieces of
  the parameters its shard holds, cut into boxes like the optimizer state;
- "master", "exp_avg", "exp_avg_sq": the optimizer's fp32 state. ZeRO ranks own disjoint
  flat ranges of the local tp shard; each rank writes the boxes of its own range (zero 0:
  every dp rank owns everything, so again dp rank 0 only; tp-replicated: tp rank 0 only);
- "expert_bias": DeepSeek-V3's expert score bias of each MoE layer (a buffer [E], not a parameter,
  the same on every rank holding the layer), whole, by the first replica at tp rank 0 of each stage;
- "rng": this rank's generator states (torch default, CUDA, each chunk's TensorParallelRNG),
  named "rank{r}/...", whole-tensor boxes;
- "powersgd_error", "powersgd_q": gradient compression's residual shares and Q, with the
  optimizer state (compression_state.py);
- DiLoCo: each replica group's inner state under "{name}@replica{g}", the outer state
  ("diloco_outer", "diloco_velocity") and the group count ("diloco") (diloco_state.py).

The last pipeline stage's copy of a tied embedding (or of the embedding MTP reads there) is one
logical tensor with the first stage's embedding; only the first stage's copy is written, so every
element of every full tensor is stored exactly once and a reader can check coverage by counting
elements.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.parameters import params
from megalite.checkpoint.boxes import (Box, box_numel, box_shape, box_slices, flat_range_boxes, local_to_full, relative,
                                      whole_box)
from megalite.checkpoint.compression_state import compression_items
from megalite.checkpoint.diloco_state import OUTER_KINDS, groups_item, outer_of, saving_suffix
from megalite.checkpoint.storage import DTYPE_NAMES
from megalite.distributed.mesh import Mesh
from megalite.moe.bookkeeping import expert_biases

OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class Item:
    kind: str
    name: str
    box: Box
    tensor: torch.Tensor  # contiguous CPU copy, shape box_shape(box)

    def index_entry(self, file: str, offset: int) -> list:
        """Compact JSON row: [kind, name, box, dtype, file, byte offset] (the CRC32 is appended
        once the file is written, storage.attach_crcs)."""
        return [self.kind, self.name, [list(b) for b in self.box], DTYPE_NAMES[self.tensor.dtype], file, offset]


def _cpu_copy(view: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(view.shape, dtype=view.dtype, pin_memory=pin)
    out.copy_(view, non_blocking=pin)
    return out


def is_tied_copy(chunk, local_name: str) -> bool:
    """The last stage's copy of the word embedding (stored once, by the first stage): a tied head, or the
    embedding DeepSeek's MTP reads on a last stage that is not the first."""
    if local_name == "word_embeddings.weight":
        return getattr(chunk, "mtp_on_last_stage", False)
    return local_name == "output_weight" and chunk.config.tie_embeddings


def writes(chunk, local_name: str, param, mesh: Mesh) -> bool:
    """Whether this rank stores `param` (one copy of each element among the replicas)."""
    if is_tied_copy(chunk, local_name):
        return False
    return params.shard_spec(param).is_tp_sharded or mesh.tp_rank == 0


def first_replica(param, mesh: Mesh) -> bool:
    """Whether this rank is the first of `param`'s replicas: dp rank 0 and cp rank 0, or for an
    expert under expert parallelism the first of its expert-data-parallel group (the ep ranks
    hold different experts, each stored by its own)."""
    if mesh.expert_replicas_apart and params.is_expert_parallel(param):  # etp = 1: its first is also tp rank 0
        return mesh.expert_dp_rank == 0
    return mesh.dp_rank == 0 and mesh.cp_rank == 0


def model_items(chunks, mesh: Mesh, pin: bool = False, copy: bool = True) -> list[Item]:
    """The parameter boxes this rank stores; copy=False keeps CPU views (a synchronous save
    writes them before training touches the parameters again). Weights are replicated over dp
    and cp: only the first replica writes them (`first_replica`)."""
    items = []
    for chunk in chunks:
        for local_name, param in chunk.named_parameters():
            if not writes(chunk, local_name, param, mesh) or not first_replica(param, mesh):
                continue
            name, spec, data = chunk.logical_name(local_name), params.shard_spec(param), param.detach()
            whole = tuple((0, n) for n in data.shape)
            for local_box, full_box in local_to_full(spec, whole):
                view = data[box_slices(local_box)]
                keep_view = not copy and view.device.type == "cpu"
                items.append(Item("model", name, full_box, view.contiguous() if keep_view else _cpu_copy(view, pin)))
    return items


def expert_bias_items(chunks, mesh: Mesh, pin: bool = False) -> list[Item]:
    """The expert biases of this stage's MoE layers; stored once (tp, dp and cp rank 0: every other rank of
    the stage, ep ranks included, holds the same values)."""
    if mesh.tp_rank != 0 or mesh.dp_rank != 0 or mesh.cp_rank != 0:
        return []
    return [Item("expert_bias", chunk.logical_name(name), whole_box(tuple(bias.shape)), _cpu_copy(bias, pin))
            for chunk in chunks for name, bias in expert_biases(chunk)]


def optimizer_param_specs(chunks, mesh: Mesh) -> dict[str, object]:
    """{logical name: ShardSpec} of the parameters whose optimizer state (ZeRO-3: also weights) this rank
    stores. Whole experts on every tp rank (etp = 1) are ZeRO-sharded over expert-dp x tp, so each tp rank
    stores its own pieces (at ZeRO 0 only their first replica stores them: `optimizer_items`)."""
    return {chunk.logical_name(n): params.shard_spec(p) for chunk in chunks for n, p in chunk.named_parameters()
            if writes(chunk, n, p, mesh) or (mesh.experts_whole and params.is_expert_parallel(p))}


def _range_items(flats: dict[str, torch.Tensor], name: str, spec, shape: tuple[int, ...], start: int,
                 end: int) -> list[Item]:
    """Boxes of the flat range [start, end) of a local tensor of `shape`, for each kind in `flats`
    (kind -> private CPU copy of that range)."""
    items, cursor = [], 0  # flat_range_boxes cuts the range in order; each box is a contiguous run of it
    for local_box in flat_range_boxes(shape, start, end):
        n = box_numel(local_box)
        for local_sub, full_box in local_to_full(spec, local_box):
            for kind, flat in flats.items():
                run = flat[cursor:cursor + n].view(box_shape(local_box))
                items.append(Item(kind, name, full_box, run[box_slices(relative(local_sub, local_box))].contiguous()))
        cursor += n
    return items


def sharded_model_items(chunks, model, mesh: Mesh, pin: bool = False) -> list[Item]:
    """ZeRO-3: every dp rank stores the parameter pieces its shard holds (each element once over dp)."""
    if mesh.dp_replicate_rank != 0:  # hybrid sharding: replica group 0's shards stand for every copy
        return []
    specs = optimizer_param_specs(chunks, mesh)
    items = []
    for piece in model.owned_pieces():
        name = model.names[piece.param]
        if name in specs:
            values = model.param_buffer.shard[piece.shard_start:piece.shard_end]  # fp32 (the master)
            flat = _cpu_copy(values.to(model.params[piece.param].dtype), pin)  # stored in the parameter dtype
            items += _range_items({"model": flat}, name, specs[name], tuple(model.params[piece.param].shape),
                                  piece.local_start, piece.local_end)
    return items


def _first_in_replica_group(param, mesh: Mesh) -> bool:
    """ZeRO 0 under DiLoCo: whether this rank is the first holder of `param` within its replica group (each
    group stores its own state; DiLoCo refuses experts, so only the dense rule applies)."""
    return mesh.dp_rank % mesh.dp_shard_size == 0 and mesh.cp_rank == 0


def optimizer_items(chunks, optimizer, mesh: Mesh) -> tuple[list[Item], dict]:
    """Boxes of this rank's owned optimizer state, plus {'step', 'loss_scaler'} for the metadata. Under DiLoCo
    every replica group stores its own, and group 0 the outer state (diloco_state.py)."""
    state = optimizer.optimizer_state()  # fp32 CPU copies of the owned flat ranges
    extras = {"step": state["step"], "loss_scaler": state["loss_scaler"]}
    specs = optimizer_param_specs(chunks, mesh)
    suffix = saving_suffix(optimizer, mesh)
    if optimizer.zero_stage > 0 and suffix is None:  # hybrid sharding: replica group 0 stores
        specs = {}
    if optimizer.zero_stage == 0:  # replicas store nothing (ZeRO: disjoint shards, each stores its own)
        first = _first_in_replica_group if outer_of(optimizer) is not None else first_replica
        replicas = {chunk.logical_name(n): first(p, mesh) for chunk in chunks for n, p in chunk.named_parameters()}
        specs = {name: spec for name, spec in specs.items() if replicas[name]}
    items = []
    for name, entry in state["params"].items():
        if name in specs:
            items += _range_items({kind: entry[kind] for kind in OPTIMIZER_KINDS}, name + (suffix or ""),
                                  specs[name], tuple(entry["shape"]), entry["start"], entry["end"])
    if outer_of(optimizer) is not None and suffix == "":  # DiLoCo: replica group 0 stores the outer state
        for name, entry in optimizer.outer.checkpoint_state().items():
            if name in specs:
                items += _range_items({kind: entry[kind] for kind in OUTER_KINDS}, name, specs[name],
                                      tuple(entry["shape"]), entry["start"], entry["end"])
    return items, extras


def rng_items(chunks, mesh: Mesh) -> list[Item]:
    """This rank's generator states; restored only when the layout is unchanged."""
    prefix = f"rank{mesh.rank}/"
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and mesh.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(mesh.device)
    for c, chunk in enumerate(chunks):
        for stream, state in chunk.rng.get_state().items():
            states[f"chunk{c}/{stream}"] = state.cpu()
    return [Item("rng", prefix + key, ((0, s.numel()),), s.clone().contiguous()) for key, s in states.items()]


def collect(chunks, optimizer, mesh: Mesh, include_optimizer: bool = True,
            copy: bool = True) -> tuple[list[Item], dict]:
    """Everything this rank writes, as CPU copies (copy=False: CPU parameters as views), and
    the optimizer's scalar state."""
    pin = torch.cuda.is_available() and mesh.device.type == "cuda"
    if optimizer is not None and hasattr(optimizer, "wait_for_params"):
        optimizer.wait_for_params()  # --overlap-param-gather: the last step's gathers must have landed
    wrapper = getattr(optimizer, "model", None)
    if getattr(wrapper, "zero_stage", 0) == 3:  # the parameters exist only as shards
        items = sharded_model_items(chunks, wrapper, mesh, pin)
    else:
        items = model_items(chunks, mesh, pin, copy)
    items += expert_bias_items(chunks, mesh, pin)
    extras = {"step": 0, "loss_scaler": None}
    if include_optimizer and optimizer is not None:
        opt_items, extras = optimizer_items(chunks, optimizer, mesh)
        extra = compression_items(optimizer, mesh) + groups_item(optimizer, mesh)
        items += opt_items + [Item(*item) for item in extra]
    items += rng_items(chunks, mesh)
    if pin:
        torch.cuda.synchronize()  # the non-blocking device-to-host copies above have landed
    return items, extras
