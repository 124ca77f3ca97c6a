"""DistributedOptimizer.state_dict / load_state_dict: torch's shape, every tensor whole.

    {"state": {name: {"step": tensor, "exp_avg": full tensor, "exp_avg_sq": full tensor,
                      ["master": full fp32 tensor, where the optimizer keeps its own copy]}},
              (a Muon group's matrix: {"step", "momentum_buffer": full tensor, ["master"]}, as torch.optim.Muon)
     "param_groups": [{"lr", "betas", "eps", "weight_decay", ..., "params": [name, ...]}],
     "loss_scaler": dict | None}

Keys are the parameters' layout-free logical names (as torch.distributed.checkpoint's
`get_optimizer_state_dict` keys them by fully qualified name), and each tensor is the full
logical tensor (all tp shards assembled, all ZeRO shards summed in), so a state dict taken at
(tp 2, dp 2, ZeRO 1) loads at (tp 1, dp 4, ZeRO 3): each rank keeps its pieces. A rank's dict
holds its own pipeline stage's parameters; the stages' dicts together hold the model's.

Taking one is collective over the mesh (every rank calls it): one all-reduce over dp x cp
(ZeRO 1-3: each element is owned by one rank) and one all-gather over tp per tp-sharded
parameter. Expert-parallel parameters are refused: their optimizer state goes through the
checkpoint (megalite.checkpoint), which stores it piece by piece.
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params as P

KINDS = ("exp_avg", "exp_avg_sq")
MUON_KEYS = {"exp_avg": "momentum_buffer"}  # where a Muon matrix's state sits in the optimizer, by torch's name


def _refuse_experts(optimizer) -> None:
    experts = [n for n, p in zip(optimizer.names, optimizer.params) if P.is_expert_parallel(p)]
    if experts:
        raise ValueError(f"DistributedOptimizer.state_dict does not gather expert-parallel parameters "
                         f"({experts[0]!r}, ...); save and load the optimizer with megalite.checkpoint instead")


def _local_state(optimizer, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{kind: [sum of local numel]} fp32 flat tensors, this rank's owned pieces written in, zero elsewhere
    (the wrapper's parameter order, each parameter's flattened local tensor in turn)."""
    offsets, total = [], 0
    for p in optimizer.params:
        offsets.append(total)
        total += p.numel()
    flats = {kind: torch.zeros(total, dtype=torch.float32, device=optimizer.exp_avg.device) for kind in kinds}
    for piece in optimizer.pieces:
        dst = slice(offsets[piece.param] + piece.local_start, offsets[piece.param] + piece.local_end)
        for kind in kinds:
            source = optimizer.master_range(piece.shard_start, piece.shard_end) if kind == "master" \
                else getattr(optimizer, kind)[piece.shard_start:piece.shard_end]
            flats[kind][dst] = source
    if optimizer.zero_stage > 0:  # each element is owned by exactly one rank of dp x cp: the sum is the whole
        for kind in kinds:
            flats[kind] = flats[kind].to(optimizer.device)
            comm.all_reduce(flats[kind], optimizer.mesh.zero_group)  # hybrid sharding: one replica's shards
    return flats


def _full(local: torch.Tensor, param, mesh) -> torch.Tensor:
    """The full logical tensor (unpadded) from every tp rank's `local` (this rank's shard of it)."""
    spec = P.shard_spec(param)
    if spec.dim is None:
        return local.cpu().clone()
    # [tp, local...]; at tp 1 only the padding (a vocabulary padded to a multiple of tp) is dropped
    gathered = comm.all_gather(local.contiguous().reshape(1, *local.shape), mesh.tp_group if spec.is_tp_sharded
                               else None)
    return spec.assemble([shard.cpu() for shard in gathered.unbind(0)])


def full_state_dict(optimizer) -> dict:
    """The optimizer's state as described in the module docstring (collective: every rank calls it)."""
    _refuse_experts(optimizer)
    kinds = KINDS if optimizer.shares_master else KINDS + ("master",)
    flats = _local_state(optimizer, kinds)
    state, offset = {}, 0
    step = torch.tensor(float(optimizer.step_count))
    for index, (name, p) in enumerate(zip(optimizer.names, optimizer.params)):
        entry = {"step": step.clone()}
        for kind in kinds:
            full = _full(flats[kind][offset:offset + p.numel()].view(p.shape), p, optimizer.mesh)
            if not _is_muon(optimizer, index):
                entry[kind] = full
            elif kind != "exp_avg_sq":  # Muon keeps one buffer, in exp_avg's place
                entry[MUON_KEYS.get(kind, kind)] = full
        state[name] = entry
        offset += p.numel()
    name_of = {id(p): n for n, p in zip(optimizer.names, optimizer.params)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    scaler = optimizer.loss_scaler.state_dict() if optimizer.loss_scaler is not None else None
    return {"state": state, "param_groups": groups, "loss_scaler": scaler}


def _is_muon(optimizer, index: int) -> bool:
    return optimizer.muon is not None and index in optimizer.muon.group_of


def _check_groups(optimizer, groups: list[dict]) -> None:
    name_of = {id(p): n for n, p in zip(optimizer.names, optimizer.params)}
    mine = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if len(groups) != len(mine) or any(sorted(a) != sorted(b["params"]) for a, b in zip(mine, groups)):
        raise ValueError(f"the state dict's {len(groups)} param groups hold other parameters than this optimizer's "
                         f"{len(mine)}; build the optimizer with the same groups")


@torch.no_grad()
def load_full_state_dict(optimizer, state_dict: dict) -> None:
    """Inverse of `full_state_dict` at any layout: each rank copies the pieces it owns (no communication
    but the parameters' gather after a master was loaded)."""
    _refuse_experts(optimizer)
    _check_groups(optimizer, state_dict["param_groups"])
    state = state_dict["state"]
    has_master = all("master" in state.get(n, {}) for n in optimizer.names)
    for piece in optimizer.pieces:
        name, p = optimizer.names[piece.param], optimizer.params[piece.param]
        if name not in state:
            raise KeyError(f"optimizer state dict has no entry for parameter {name!r}")
        spec, local = P.shard_spec(p), slice(piece.local_start, piece.local_end)
        muon = _is_muon(optimizer, piece.param)
        for kind in KINDS + (("master",) if has_master else ()):
            if muon and kind == "exp_avg_sq":  # no second moment
                continue
            key = MUON_KEYS.get(kind, kind) if muon else kind
            if key not in state[name]:
                raise KeyError(f"optimizer state dict has no {key!r} for parameter {name!r}: saved by another "
                               f"optimizer (AdamW keeps exp_avg and exp_avg_sq, Muon momentum_buffer)")
            values = spec.shard(state[name][key].float()).reshape(-1)[local].to(optimizer.exp_avg.device)
            target = optimizer.master_range(piece.shard_start, piece.shard_end) if kind == "master" \
                else getattr(optimizer, kind)[piece.shard_start:piece.shard_end]
            target.copy_(values)
    steps = {int(entry["step"]) for entry in state.values()}
    if len(steps) != 1:
        raise ValueError(f"optimizer state dict holds parameters at different steps {sorted(steps)}")
    optimizer.step_count = steps.pop()
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    if optimizer.loss_scaler is not None and state_dict.get("loss_scaler") is not None:
        optimizer.loss_scaler.load_state_dict(state_dict["loss_scaler"])
    if has_master:
        optimizer.publish_params()
