"""PowerSGD's state in a checkpoint (megalite/data_parallel/powersgd.py): every replica's share
of the residual, and the warm-start Q.

Stored kinds (beside the weights and the optimizer state, in the same boxes of full tensors):
- "powersgd_error", name "{logical name}@replica{r}": replica r's (rank r of the parameter's
  replica group: dp x cp, or expert-dp for experts kept apart) residual share E_r of a compressed
  parameter, as boxes of the full logical tensor (tp shards mapped like the weights); written by
  tp rank 0 for tp-replicated dense parameters, by every rank for experts kept apart (tp-sharded,
  or whole at etp 1, where each tp rank is a replica of its own), and by the first stage for a
  tied embedding, so every element of every share is stored once. Experts are named by their
  global index, so the names never depend on ep.
- "powersgd_q", name "{logical name}@tp{t}of{T}" (tp-sharded) or "{logical name}": the Q [m, r]
  of that matrix, the same on every replica: written by replica 0.

Loading (with the optimizer state; `--no-load-optim` starts the compressor afresh too), per
parameter, counting the replicas whose shares are stored (a dense matrix's were dp x cp, an
expert's expert-dp when saved apart, dp x cp otherwise):
- the same number of replicas: each replica reads its own share, whatever tp/pp now slice it;
  at the same layout the run continues exactly as if never interrupted;
- another number of replicas: replica 0 reads the SUM of every stored share, the others start
  at zero. The compressor depends on the shares only through their sum (powersgd.py), so the
  total residual, the only quantity the next steps use, carries over exactly (an expert saved
  at (dp 4, ep 2) with 2 shares resumes at (dp 4, ep 1) with their sum on replica 0);
- Q is restored where one of the same name and shape was stored (same tp size and rank r);
  otherwise the matrix starts from its first random Q (the warm start is lost, nothing else);
- a parameter compressed now but not when saved (or a checkpoint without compression) starts
  with a zero residual; a residual stored for a parameter not compressed now is dropped;
- the warm-up counter resumes at the checkpoint's step.

Under hybrid sharding (--dp-shard S < dp) the compressor sums over the replica group only, once per
shard position (grad_buffers.py), so every rank's share is its own and every position has its own Q:
the shares are numbered by the rank in the whole replica set (dp x cp, or expert-dp), as flat dp
numbers them (a hybrid checkpoint's shares load 1:1 at the same dp x cp, and a flat one's into hybrid),
and Q is named "...@shard{s}of{S}" by the rank's shard position (restored at the same S).
"""
from __future__ import annotations

import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.checkpoint.boxes import box_shape, box_slices, local_to_full, whole_box
from megalite.data_parallel.powersgd import first_q

ERROR_KIND, Q_KIND = "powersgd_error", "powersgd_q"


def _compressor(optimizer):
    model = getattr(optimizer, "model", None)
    return model, getattr(model, "compression", None)


def _stores(param, mesh, apart: bool) -> bool:
    """One copy among the identical ones: tp rank 0 for tp-replicated, the first stage for a tied
    embedding; every rank for experts kept apart (`apart`: their replica group spans tp at etp 1)."""
    if P.is_tied_across_stages(param) and not mesh.is_first_stage:
        return False
    return apart or P.shard_spec(param).is_tp_sharded or mesh.tp_rank == 0


def _q_name(name: str, param, model, index: int) -> str:
    mesh = model.mesh
    name = f"{name}@tp{mesh.tp_rank}of{mesh.tp_size}" if P.shard_spec(param).is_tp_sharded else name
    if not model.grads.compress_replicas:
        return name
    shard_group = model.grads.groups[model.compression.kinds[index]]  # the rank's shard group (dp, or expert)
    return f"{name}@shard{comm.group_rank(shard_group)}of{comm.group_size(shard_group)}"


def _replicas(model, index: int):
    """The group whose ranks' residual shares of parameter `index` are numbered: the compressor's group,
    or under hybrid sharding every replica (dp x cp, or expert-dp for experts kept apart)."""
    compressor = model.compression
    if not model.grads.compress_replicas:
        return compressor.group_of(index)
    return model.mesh.expert_dp_group if compressor.kinds[index] == 1 else model.mesh.dp_cp_group


def compression_items(optimizer, mesh) -> list[tuple[str, str, tuple, torch.Tensor]]:
    """(kind, name, full box, CPU tensor) of this rank's PowerSGD state; [] without compression."""
    model, compressor = _compressor(optimizer)
    if compressor is None:
        return []
    items = []
    for index in compressor.matrices:
        name, param = model.names[index], model.params[index]
        if not _stores(param, mesh, apart=compressor.kinds[index] == 1):
            continue
        replica = comm.group_rank(_replicas(model, index))
        spec, error = P.shard_spec(param), compressor.error_of(index).view(param.shape)
        for local_box, full_box in local_to_full(spec, whole_box(tuple(param.shape))):
            items.append((ERROR_KIND, f"{name}@replica{replica}", full_box,
                          error[box_slices(local_box)].detach().cpu().clone()))
        if comm.group_rank(compressor.group_of(index)) == 0:  # Q: the same on the replicas summed together
            q = compressor.q_of(index)
            items.append((Q_KIND, _q_name(name, param, model, index), whole_box(tuple(q.shape)), q.detach().cpu().clone()))
    return items


def _sources(reader, model, index: int, name: str) -> list[int]:
    """The stored replicas whose shares of `name` this rank's replica sums (see the module docstring)."""
    saved = 0
    while reader.has(ERROR_KIND, f"{name}@replica{saved}"):
        saved += 1
    group = _replicas(model, index)
    replica = comm.group_rank(group)
    if saved == comm.group_size(group):
        return [replica]
    return list(range(saved)) if replica == 0 else []


def _reads(reader, optimizer):
    """[(index, kind, stored name, local box, full box)] of every stored box this rank will read."""
    model, compressor = _compressor(optimizer)
    if compressor is None:
        return []
    out = []
    for index in compressor.matrices:
        name, param = model.names[index], model.params[index]
        for source in _sources(reader, model, index, name):
            for local_box, full_box in local_to_full(P.shard_spec(param), whole_box(tuple(param.shape))):
                out.append((index, ERROR_KIND, f"{name}@replica{source}", local_box, full_box))
        q_name, q_box = _q_name(name, param, model, index), whole_box(tuple(compressor.q_of(index).shape))
        if reader.has(Q_KIND, q_name) and reader.items[(Q_KIND, q_name)][0][0] == q_box:
            out.append((index, Q_KIND, q_name, q_box, q_box))
    return out


def plan_compression(reader, optimizer) -> None:
    """Check coverage and checksums of every stored box load_compression will read."""
    for _, kind, name, _, full_box in _reads(reader, optimizer):
        reader.check_covered(kind, name, full_box)
        reader.verify_box(kind, name, full_box)


@torch.no_grad()
def load_compression(reader, optimizer, step: int) -> None:
    """Set the compressor's residual shares and Q from the checkpoint (see the module docstring)."""
    model, compressor = _compressor(optimizer)
    if compressor is None:
        return
    compressor.error.zero_()
    for index, matrix in compressor.matrices.items():
        compressor.q_of(index).copy_(first_q(matrix.m, matrix.r, compressor.config.seed))
    for index, kind, name, local_box, full_box in _reads(reader, optimizer):
        piece = torch.empty(box_shape(full_box), dtype=torch.float32)
        reader.read_into(kind, name, full_box, piece)
        if kind == ERROR_KIND:
            compressor.error_of(index).view(model.params[index].shape)[box_slices(local_box)] += piece.to(
                compressor.device)
        else:
            compressor.q_of(index).copy_(piece)
    compressor.steps_done = step
