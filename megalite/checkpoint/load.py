"""Load a checkpoint of any layout into this rank's model chunks and optimizer.

    resumed = load_checkpoint("runs/ckpt", chunks, optimizer, mesh)          # latest, with fallback
    if resumed is not None:
        sampler.consumed_samples, start_step = resumed.consumed_samples, resumed.step

Each rank plans what it needs — for every parameter the boxes of its tp shard ("model"),
for every flat range its optimizer owns the boxes of that range (master, moments) — checks
that the stored boxes cover them, and verifies the CRC32 of exactly the stored boxes it will
read (and the size of their files, against the manifest).
The ranks then agree (one all_gather_object): if any rank found damage, every rank warns and
moves to the next older checkpoint; nothing is loaded from a damaged one. A checkpoint of
another model (a parameter's shape, or an architecture field, differs) or in a newer format
is a user error: every rank raises the same CheckpointMismatchError at once, before anything
is read. When `latest` was asked for (no
`step`) and the directory holds no checkpoint yet, nothing is loaded and None is returned.

MoE expert biases (DeepSeek-V3's, a buffer per layer) are stored whole and restored at any layout;
a checkpoint without them leaves them zero.

RNG states are restored only when the layout (tp, pp, dp, virtual stages) is the one that
saved them: rank r then gets back exactly its generators. Under another layout the dropout
streams differ anyway (they are seeded per tp/pp rank), so they keep their fresh seeds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.checkpoint import storage
from megalite.checkpoint.boxes import box_numel, box_shape, box_slices, flat_range_boxes, local_to_full, relative
from megalite.checkpoint.compression_state import load_compression, plan_compression
from megalite.checkpoint.diloco_state import OUTER_KINDS, loading_suffix, outer_of, stored_groups
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.snapshot import OPTIMIZER_KINDS
from megalite.checkpoint.storage import (CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError,
                                         NoIntactCheckpointError)
from megalite.errors import UsageError
from megalite.distributed.mesh import Mesh
from megalite.moe.bookkeeping import expert_biases

# GPTConfig fields that decide which parameters exist (and their shapes). seq_length is left out:
# RoPE models have no position table (a longer context is a legitimate change), and GPT-2's
# position table is caught by its shape.
ARCHITECTURE_FIELDS = ("flavour", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "ffn_hidden_size", "vocab_size", "tie_embeddings", "add_bias", "qkv_bias", "proj_bias", "mlp_bias",
                       "kv_channels", "qk_layernorm")


@dataclass
class LoadedCheckpoint:
    step: int
    consumed_samples: int
    path: Path
    metadata: dict
    rng_restored: bool


def _whole(shape) -> tuple:
    return tuple((0, n) for n in shape)


def _optimizer_targets(optimizer):
    """[(name, spec, local shape, start, end)] of the flat ranges this rank's optimizer owns."""
    by_name = dict(zip(optimizer.names, optimizer.params))
    return [(name, P.shard_spec(by_name[name]), tuple(by_name[name].shape), start, end)
            for name, (start, end) in optimizer.owned_ranges().items()]


def _sharded_model(optimizer):
    """The ZeRO-3 wrapper whose shards hold the parameters, or None (the parameters hold themselves)."""
    model = getattr(optimizer, "model", None)
    return model if getattr(model, "zero_stage", 0) == 3 else None


def _shard_targets(model):
    """ZeRO-3: [(name, spec, local shape, start, end, shard view)] of the parameter pieces this rank holds."""
    return [(model.names[x.param], P.shard_spec(model.params[x.param]), tuple(model.params[x.param].shape),
             x.local_start, x.local_end, model.param_buffer.shard[x.shard_start:x.shard_end])
            for x in model.owned_pieces()]


def _check_range(reader: CheckpointReader, kind: str, name: str, spec, shape, start: int, end: int) -> None:
    for local_box in flat_range_boxes(shape, start, end):
        for _, full_box in local_to_full(spec, local_box):
            reader.check_covered(kind, name, full_box)
            reader.verify_box(kind, name, full_box)


def _read_range(reader: CheckpointReader, kind: str, name: str, spec, shape, start: int, end: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The flat range [start, end) of a local tensor of `shape`, read from its boxes."""
    flat = torch.zeros(end - start, dtype=dtype)  # padding rows stay zero, as they train
    cursor = 0
    for local_box in flat_range_boxes(shape, start, end):
        n = box_numel(local_box)
        run = flat[cursor:cursor + n].view(box_shape(local_box))
        for local_sub, full_box in local_to_full(spec, local_box):
            reader.read_into(kind, name, full_box, run[box_slices(relative(local_sub, local_box))])
        cursor += n
    return flat


def _architecture_differences(saved: dict | None, config) -> list[str]:
    """'num_layers 4 (checkpoint) vs 2 (model)' for each field that decides the parameter set."""
    if not isinstance(saved, dict):
        return []
    current = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
    return [f"{field} {saved[field]} (checkpoint) vs {current[field]} (model)" for field in ARCHITECTURE_FIELDS
            if field in saved and field in current and saved[field] != current[field]]


def _check_same_model(reader: CheckpointReader, chunks) -> None:
    """Raise CheckpointMismatchError naming the first parameter whose shape differs (or that the
    checkpoint lacks), or the architecture fields that differ, before anything is read."""
    shapes = reader.metadata["tensors"]
    differences = _architecture_differences(reader.metadata.get("model_config"), chunks[0].config)
    saved_from = f" (saved from another model: {', '.join(differences)})" if differences else ""
    fix = "load it into the model it was saved from (same --model and shape flags)"
    for chunk in chunks:
        for name, param in chunk.logical_parameters():
            full_shape = list(P.shard_spec(param).full_shape)
            if name not in shapes:
                raise CheckpointMismatchError(f"checkpoint {reader.path} has no parameter {name!r}{saved_from}; {fix}")
            if shapes[name] != full_shape:
                raise CheckpointMismatchError(f"checkpoint {reader.path} holds {name!r} with shape {shapes[name]}, "
                                              f"the model has {full_shape}{saved_from}; {fix}")
    if differences:  # every parameter of this rank fits, but the model is another one (e.g. more layers)
        raise CheckpointMismatchError(f"checkpoint {reader.path} was saved from another model: "
                                      f"{', '.join(differences)}; {fix}")


def _plan(reader: CheckpointReader, chunks, optimizer, load_optimizer: bool, rng_prefix: str | None) -> None:
    """Check shapes and coverage of everything this rank needs; verify the stored boxes holding it."""
    _check_same_model(reader, chunks)
    sharded = _sharded_model(optimizer)
    if sharded is not None:  # ZeRO-3: only the parameter pieces this rank's shard holds
        for name, spec, shape, start, end, _ in _shard_targets(sharded):
            _check_range(reader, "model", name, spec, shape, start, end)
    else:
        for chunk in chunks:
            for name, param in chunk.logical_parameters():
                for _, full_box in local_to_full(P.shard_spec(param), _whole(param.shape)):
                    reader.check_covered("model", name, full_box)
                    reader.verify_box("model", name, full_box)
    if load_optimizer and optimizer is not None and reader.metadata["has_optimizer"]:
        suffix, outer = loading_suffix(reader, optimizer), stored_groups(reader) and outer_of(optimizer)
        for name, spec, shape, start, end in _optimizer_targets(optimizer):
            for kind in OPTIMIZER_KINDS:
                _check_range(reader, kind, name + suffix, spec, shape, start, end)
            for kind in OUTER_KINDS if outer else ():  # DiLoCo's outer state (diloco_state.py)
                _check_range(reader, kind, name, spec, shape, start, end)
        plan_compression(reader, optimizer)
    for name, bias in _expert_bias_targets(reader, chunks):
        reader.check_covered("expert_bias", name, _whole(bias.shape))
        reader.verify_box("expert_bias", name, _whole(bias.shape))
    if rng_prefix is not None:
        for (kind, name), rows in reader.items.items():
            if kind == "rng" and name.startswith(rng_prefix):
                reader.verify_box(kind, name, rows[0][0])


@torch.no_grad()
def _load_model(reader: CheckpointReader, chunks, optimizer) -> None:
    sharded = _sharded_model(optimizer)
    if sharded is not None:  # ZeRO-3: this rank's pieces, straight into its shard
        for name, spec, shape, start, end, target in _shard_targets(sharded):
            target.copy_(_read_range(reader, "model", name, spec, shape, start, end, target.dtype))
        return
    for chunk in chunks:
        for name, param in chunk.logical_parameters():
            for local_box, full_box in local_to_full(P.shard_spec(param), _whole(param.shape)):
                reader.read_into("model", name, full_box, param.data[box_slices(local_box)])


def _expert_bias_targets(reader: CheckpointReader, chunks) -> list[tuple[str, torch.Tensor]]:
    """(logical name, bias buffer) of this rank's expert biases that the checkpoint stores."""
    return [(chunk.logical_name(local), bias) for chunk in chunks for local, bias in expert_biases(chunk)
            if reader.has("expert_bias", chunk.logical_name(local))]


@torch.no_grad()
def _load_expert_biases(reader: CheckpointReader, chunks) -> None:
    """The stored expert biases; a bias the checkpoint lacks (saved without --moe-router-enable-expert-bias,
    or before biases were stored) starts at zero, as in a new run."""
    for chunk in chunks:
        for _, bias in expert_biases(chunk):
            bias.zero_()
    for name, bias in _expert_bias_targets(reader, chunks):
        stored = torch.empty(bias.shape, dtype=torch.float32)
        reader.read_into("expert_bias", name, _whole(bias.shape), stored)
        bias.copy_(stored)


@torch.no_grad()
def _load_optimizer(reader: CheckpointReader, optimizer, from_checkpoint: bool) -> None:
    """Owned ranges from the checkpoint's optimizer state, or (none stored, e.g. an HF import)
    master weights from the just-loaded parameters with zero moments and step 0."""
    params = dict(zip(optimizer.names, optimizer.params))
    sharded = _sharded_model(optimizer)
    held = {name: target for name, *_, target in _shard_targets(sharded)} if sharded is not None else {}
    entries, suffix = {}, loading_suffix(reader, optimizer) if from_checkpoint else ""
    for name, spec, shape, start, end in _optimizer_targets(optimizer):
        entry = {"start": start, "end": end}
        if not from_checkpoint:
            weights = held[name] if name in held else params[name].detach().reshape(-1)[start:end]
            entry["master"] = weights.float().cpu()
            entry["exp_avg"], entry["exp_avg_sq"] = torch.zeros(end - start), torch.zeros(end - start)
            entries[name] = entry
            continue
        for kind in OPTIMIZER_KINDS:  # under DiLoCo this replica group's own (diloco_state.py)
            entry[kind] = _read_range(reader, kind, name + suffix, spec, shape, start, end, torch.float32)
        entries[name] = entry
    meta = reader.metadata
    optimizer.load_optimizer_state({"step": meta["optimizer_step"] if from_checkpoint else 0,
                                    "loss_scaler": meta["loss_scaler"] if from_checkpoint else None,
                                    "params": entries})


@torch.no_grad()
def _load_outer(reader: CheckpointReader, optimizer, from_checkpoint: bool) -> None:
    """DiLoCo's outer parameters and momentum (stored, or restarted from the loaded masters) and its step
    count, so the next outer step comes at the step it would have (diloco_state.py)."""
    outer = outer_of(optimizer)
    if outer is None:
        return
    entries = None
    if from_checkpoint and stored_groups(reader):
        entries = {}
        for name, spec, shape, start, end in _optimizer_targets(optimizer):
            entries[name] = {"start": start, "end": end}
            for kind in OUTER_KINDS:
                entries[name][kind] = _read_range(reader, kind, name, spec, shape, start, end, torch.float32)
    outer.load_checkpoint_state(entries, steps=reader.metadata["step"])


def _same_layout(meta: dict, mesh: Mesh, chunks) -> bool:
    """RNG streams are per rank and depend on its coordinates (dropout streams on the cp rank too)."""
    saved = meta["layout"]
    return (saved["tp"], saved["pp"], saved["dp"], saved.get("cp", 1), saved["virtual_stages"]) == \
        (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.cp_size, len(chunks))


def _load_rng(reader: CheckpointReader, chunks, mesh: Mesh) -> None:
    prefix = f"rank{mesh.rank}/"

    def state(key: str) -> torch.Tensor:
        (box, dtype, *_), = reader.items[("rng", prefix + key)]
        out = torch.empty(box_shape(box), dtype=dtype)
        reader.read_into("rng", prefix + key, box, out)
        return out

    torch.set_rng_state(state("torch"))
    if reader.has("rng", prefix + "cuda") and mesh.device.type == "cuda":
        torch.cuda.set_rng_state(state("cuda"), mesh.device)
    for c, chunk in enumerate(chunks):
        current = chunk.rng.get_state()
        chunk.rng.set_state({stream: state(f"chunk{c}/{stream}").to(current[stream].device) for stream in current})


def _candidates(root: Path, step: int | None, log) -> list[int]:
    """Steps to try, best first (rank 0 decides; every rank gets its list)."""
    steps = storage.complete_steps(root)
    if step is not None:
        if step not in steps:
            raise FileNotFoundError(f"--load-step {step}: no complete checkpoint {root / storage.step_dir_name(step)}; "
                                    f"available steps: {steps or 'none'}")
        return [step]
    latest = storage.latest_step(root)
    if latest is not None and latest not in steps:
        log(f"megalite: warning: {root / storage.LATEST} names step {latest}, which is not a complete "
            f"checkpoint; trying older ones")
    return [s for s in reversed(steps) if latest is None or s <= latest]


def _agreed_candidates(root: Path, step: int | None, mesh: Mesh, say) -> list[int]:
    """Rank 0 lists the step directories to try, newest first; every rank gets its list (or its error)."""
    decision: tuple[str, object] = ("ok", None)
    if mesh.rank == 0:
        try:
            decision = ("ok", _candidates(root, step, say))
        except FileNotFoundError as exc:
            decision = ("error", str(exc))
    decision = comm.all_gather_object(decision, comm.world_group())[0]
    if decision[0] == "error":
        raise CheckpointNotFoundError(decision[1])
    return decision[1]


def _load_everything(reader: CheckpointReader, chunks, optimizer, mesh: Mesh, load_optimizer: bool,
                     rng: bool) -> None:
    """Read a planned and verified checkpoint into the model, the optimizer (without stored or wanted
    state: master weights from the loaded weights), the MoE expert biases, gradient compression's state
    and the RNGs."""
    meta = reader.metadata
    _load_model(reader, chunks, optimizer)
    _load_expert_biases(reader, chunks)
    if optimizer is not None:
        _load_optimizer(reader, optimizer, from_checkpoint=meta["has_optimizer"] and load_optimizer)
        _load_outer(reader, optimizer, from_checkpoint=meta["has_optimizer"] and load_optimizer)
        if meta["has_optimizer"] and load_optimizer:  # gradient compression's residuals and Q
            load_compression(reader, optimizer, meta["step"])
    if rng:
        _load_rng(reader, chunks, mesh)
    reader.close()


def _try_on_every_rank(path: Path, chunks, optimizer, mesh: Mesh, load_optimizer: bool, load_rng: bool):
    """Open and plan the load of one checkpoint on every rank, and agree on the outcome.

    Returns (reader, whether this rank restores its RNG states, [(rank, kind, message)] of the ranks
    that found it damaged). A usage error (another model, a newer format) or an unexpected failure
    on any rank raises on every rank: no fallback to an older checkpoint would mend those."""
    outcome, reader, rng = ("ok", ""), None, False
    try:
        reader = CheckpointReader(path)
        rng = (load_rng and _same_layout(reader.metadata, mesh, chunks)
               and reader.has("rng", f"rank{mesh.rank}/torch"))
        _plan(reader, chunks, optimizer, load_optimizer, f"rank{mesh.rank}/" if rng else None)
    except CheckpointCorruptError as exc:
        outcome = ("corrupt", str(exc))
    except UsageError as exc:  # another model, a newer format: the same error on every rank, no fallback
        outcome = ("usage", str(exc), type(exc))
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below, or peers hang
        outcome = ("failed", f"{path}: {type(exc).__name__}: {exc}")
    outcomes = comm.all_gather_object(outcome, comm.world_group())
    bad = [(r, o[0], o[1]) for r, o in enumerate(outcomes) if o[0] != "ok"]
    usage = [(r, o[1], o[2]) for r, o in enumerate(outcomes) if o[0] == "usage"]
    if usage:
        rank, message, error = usage[0]
        raise error(message if len({m for _, m, _ in usage}) == 1 else f"rank {rank}: {message}")
    failed = [f"rank {r}: {msg}" for r, kind, msg in bad if kind == "failed"]
    if failed:
        raise RuntimeError(failed[0])
    return reader, rng, bad


def _loaded_line(path: Path, meta: dict, rng: bool) -> str:
    saved = meta["layout"]
    return (f"megalite: loaded {path} (step {meta['step']}, {meta['consumed_samples']} samples consumed; saved at "
            f"tp={saved['tp']} pp={saved['pp']} dp={saved['dp']} "
            + (f"cp={saved['cp']} " if saved.get("cp", 1) > 1 else "") + f"zero={saved['zero_stage']} "
            f"v={saved['virtual_stages']}" + ("" if rng else "; RNG states not restored: another layout, or none "
                                                "stored") + ")")


def load_checkpoint(load_dir: str | Path, chunks, optimizer, mesh: Mesh, *, step: int | None = None,
                    load_optimizer: bool = True, load_rng: bool = True, log=print) -> LoadedCheckpoint | None:
    """Load the newest good checkpoint (or `step`) of `load_dir` into chunks and optimizer.

    Returns None (after a notice) when `load_dir` has no checkpoint yet and no step was asked
    for. Raises NoIntactCheckpointError (a UsageError and CheckpointCorruptError) when no candidate
    is intact, CheckpointMismatchError (a UsageError) when the checkpoint holds another model or a
    newer format, CheckpointNotFoundError when `step` does not exist. Every rank must call it (it communicates); every rank raises the same.
    """
    root = Path(load_dir)
    named = storage.STEP_DIR.match(root.name)
    if named and (root / storage.MANIFEST).exists():  # a step directory itself: load exactly that one
        root, step = root.parent, int(named.group(1))
    say = log if mesh.rank == 0 else (lambda *_: None)
    candidates = _agreed_candidates(root, step, mesh, say)
    if not candidates:
        say(f"megalite: no checkpoint in {root} yet; starting from scratch")
        return None

    problems = []
    for candidate in candidates:
        path = root / storage.step_dir_name(candidate)
        reader, rng, bad = _try_on_every_rank(path, chunks, optimizer, mesh, load_optimizer, load_rng)
        if bad:
            rank, _, message = bad[0]
            problems.append(message)
            say(f"megalite: warning: checkpoint {path} is damaged (rank {rank}: {message}); "
                + ("falling back to an older checkpoint" if candidate != candidates[-1] else "no older one left"))
            continue
        meta = reader.metadata
        _load_everything(reader, chunks, optimizer, mesh, load_optimizer, rng)
        say(_loaded_line(path, meta, rng))
        return LoadedCheckpoint(meta["step"], meta["consumed_samples"], path, meta, rng)
    raise NoIntactCheckpointError(f"--load {root}: no intact checkpoint ({len(problems)} damaged: "
                                  + "; ".join(problems) + "); point --load at another directory, or move the "
                                  "damaged step directories away to start from scratch")
