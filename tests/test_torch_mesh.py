"""mesh.device_mesh: torch's DeviceMesh over megalite's own groups; DTensor and FSDP2 run on it.

The oracle for each dimension is megalite.distributed.comm over the Mesh's group of that name.
"""
import pytest
import torch
from torch import nn
# imported here, before the ranks fork: a child importing them could block on an import lock that a
# thread of the parent held at the fork (the suite's earlier tests leave threads behind)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.testing import run_distributed


def _dtensor_on_tp_and_dp():
    mesh = mesh_lib.init_mesh(tp=2, dp=2)
    dm = mesh.device_mesh
    assert dm.mesh_dim_names == ("pp", "dp", "cp", "tp") and tuple(dm.shape) == (1, 2, 1, 2)
    assert dm["tp"].get_group() is mesh.tp_group and dm["dp"].get_group() is mesh.dp_group
    assert dm["tp"].get_local_rank() == mesh.tp_rank and dm["dp"].get_local_rank() == mesh.dp_rank
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * mesh.rank
    summed = DTensor.from_local(local, dm["tp"], [Partial()]).redistribute(dm["tp"], [Replicate()]).to_local()
    gathered = DTensor.from_local(local, dm["dp"], [Shard(0)]).full_tensor()  # [2*dp, 3]
    return (torch.equal(summed, comm.all_reduce(local.clone(), mesh.tp_group)),
            torch.equal(gathered, comm.all_gather(local, mesh.dp_group)))


@pytest.mark.slow
def test_dtensor_on_device_mesh_equals_megalite_collectives_on_the_same_groups():
    assert run_distributed(_dtensor_on_tp_and_dp, 4, timeout_s=120) == [(True, True)] * 4


def _fsdp2_on_dp():
    mesh = mesh_lib.init_mesh(dp=2)
    torch.manual_seed(0)
    plain = nn.Linear(4, 3)
    sharded = nn.Linear(4, 3)
    sharded.load_state_dict(plain.state_dict())
    fully_shard(sharded, mesh=mesh.device_mesh["dp"])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(mesh.dp_rank))  # each dp rank its own rows
    sharded(x).square().sum().backward()
    plain(x).square().sum().backward()
    expected = comm.all_reduce(plain.weight.grad.clone(), mesh.dp_group) / 2  # FSDP averages over dp
    got = sharded.weight.grad.full_tensor()
    return float((got - expected).abs().max())


@pytest.mark.slow
def test_fsdp2_over_the_dp_dimension_averages_gradients_like_megalite_dp():
    assert max(run_distributed(_fsdp2_on_dp, 2, timeout_s=120)) < 1e-6


def _ep_mesh():
    mesh = mesh_lib.init_mesh(dp=4, ep=2, num_experts=2)
    em = mesh.ep_device_mesh
    return (tuple(em.shape), em["ep"].get_group() is mesh.ep_group, em["edp"].get_group() is mesh.expert_dp_group,
            em["ep"].get_local_rank() == mesh.ep_rank)


@pytest.mark.slow
def test_ep_device_mesh_dims_are_the_expert_groups():
    assert run_distributed(_ep_mesh, 4, timeout_s=120) == [((1, 2, 2, 1), True, True, True)] * 4
