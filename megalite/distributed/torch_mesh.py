"""megalite's Mesh as torch's DeviceMesh, over the very process groups megalite communicates on.

    mesh = init_mesh(tp=2, dp=2)
    dm = mesh.device_mesh                      # DeviceMesh, dims ("pp", "dp", "cp", "tp")
    x = distribute_tensor(w, dm["tp"], [Shard(0)])          # DTensor over mesh.tp_group's ranks
    fully_shard(block, mesh=dm["dp"])                       # FSDP2 over mesh.dp_group's ranks
    em = mesh.ep_device_mesh                   # dims ("pp", "edp", "ep", "tp"): experts' layout

Each dimension's process group IS the Mesh's (`DeviceMesh.from_group`): a collective on
`dm["tp"]` runs on `mesh.tp_group`, nothing new is created, except for a dimension of size 1
whose Mesh group does not exist (cp = 1: `cp_group` is None): there one group holding only this
rank stands in, made locally (no other rank takes part). The rank tensor is megalite's order
(tp fastest, then cp, dp, pp): `torch.arange(world).reshape(pp, dp, cp, tp)`.

The first access is not collective; it is cached on the Mesh. torch's own pieces on it (DTensor,
FSDP2, torch's context parallel, torchao) use it as they would `init_device_mesh`'s mesh; their
collectives bypass megalite.distributed.comm's ledger.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from megalite.distributed import comm

DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "tp")


def _singleton(mesh) -> object:
    """A group of this rank alone (size-1 dimensions without a Mesh group), made once per Mesh."""
    cache = mesh._torch_meshes
    if "singleton" not in cache:
        cache["singleton"] = comm.new_local_group([mesh.rank], "self")
    return cache["singleton"]


def _group_or_self(mesh, group, size: int):
    if size > 1 or (group is not None and comm.group_size(group) == 1):
        return group
    return _singleton(mesh)


def _check_distributed(mesh) -> None:
    if not comm.is_initialized():
        raise ValueError("mesh.device_mesh needs a process group: init_mesh under torchrun (or "
                         "megalite.testing.run_distributed); a single process without one has none to offer")


def build_device_mesh(mesh) -> DeviceMesh:
    """DeviceMesh with dims ("pp", "dp", "cp", "tp") over the Mesh's groups (see the module docstring)."""
    _check_distributed(mesh)
    sizes = (mesh.pp_size, mesh.dp_size, mesh.cp_size, mesh.tp_size)
    groups = [_group_or_self(mesh, g, n) for g, n in zip((mesh.pp_group, mesh.dp_group, mesh.cp_group,
                                                           mesh.tp_group), sizes)]
    ranks = torch.arange(mesh.world_size, dtype=torch.int).reshape(sizes)  # megalite's rank order
    return DeviceMesh.from_group(groups, mesh.device.type, ranks, mesh_dim_names=DIMS)


def build_ep_device_mesh(mesh) -> DeviceMesh:
    """DeviceMesh with dims ("pp", "edp", "ep", "tp") of the experts' layout: ep consecutive members of
    dp x cp hold different experts, the edp = dp*cp/ep members the same ones (etp = tp only)."""
    _check_distributed(mesh)
    if mesh.experts_whole:
        raise ValueError(f"ep_device_mesh needs experts split over tp like the dense layers (etp = tp = "
                         f"{mesh.tp_size}); at etp = 1 the expert-dp group spans tp and is not a mesh dimension")
    edp = mesh.dp_size * mesh.cp_size // mesh.ep_size
    sizes = (mesh.pp_size, edp, mesh.ep_size, mesh.tp_size)
    groups = [_group_or_self(mesh, g, n) for g, n in zip((mesh.pp_group, mesh.expert_dp_group, mesh.ep_group,
                                                           mesh.tp_group), sizes)]
    ranks = torch.arange(mesh.world_size, dtype=torch.int).reshape(sizes)
    return DeviceMesh.from_group(groups, mesh.device.type, ranks, mesh_dim_names=EXPERT_DIMS)
