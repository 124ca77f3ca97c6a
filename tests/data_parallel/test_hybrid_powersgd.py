"""PowerSGD under hybrid sharding compresses only the replicas' sum (megalite/data_parallel/grad_buffers.py).

- Against the same algorithm: at dp 2 as 2 replica groups of S = 1 the replica group is all of dp, so
  the compressed run must equal flat-dp PowerSGD at the same rank (rank 2: far from exact) step for step.
- Exact at full rank (r >= min(n, m) of every matrix, min compression 0): P^ spans the sum's columns, so
  the decompressed sum is the sum, and the run equals plain hybrid sharding to 1e-5 (dp 4 as 2 x 2, slow:
  the shard group's reduction is the exact one, the compressed sum the replicas').
- Bytes: the replica group carries P, Q and the uncompressed gradients, exactly the planner's
  'dp_replicate/all_reduce' (megalite/plan/compression.py), and fewer bytes than the plain replica
  all-reduce of the shard at rank 2; the shard group's reduction is the uncompressed one's.
"""
import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.testing import assert_tensor_close, run_distributed

from test_hybrid_shard import _cfg, _train

LOW = dict(grad_compression="powersgd", powersgd_rank=2, powersgd_min_compression=0.0)
FULL = dict(grad_compression="powersgd", powersgd_rank=64, powersgd_min_compression=0.0)


def _close(run, reference, what):
    assert_tensor_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, what=f"{what} losses")
    for name, (_, value) in reference["params"].items():
        assert_tensor_close(run["params"][name][1], value, rtol=1e-5, what=f"{what} {name}")


def _two_replicas(zero):
    flat = _train(mesh_lib.init_mesh(dp=2, replace=True), _cfg(dp=2, zero=zero, **LOW))
    hybrid = _train(mesh_lib.init_mesh(dp=2, dp_shard=1, replace=True), _cfg(dp=2, dp_shard=1, zero=zero, **LOW))
    _close(hybrid, flat, f"zero {zero}: hybrid S=1 vs flat PowerSGD")
    return hybrid["ledger"], hybrid["plan"], hybrid["shard"]


def test_powersgd_across_two_replica_groups_is_flat_powersgd_and_counted():
    for ledger, plan, shard in run_distributed(_two_replicas, 2, 1, timeout_s=120):
        sent = ledger[("dp_replicate", "all_reduce")]
        assert sent == plan["dp_replicate/all_reduce"], (ledger, plan)
        assert sent < 4 * shard, (sent, 4 * shard)  # fewer bytes than the plain replica all-reduce of the shard
        assert not any(group == "dp" for group, _ in ledger), ledger


def _two_by_two(zero):
    m = mesh_lib.init_mesh(dp=4, dp_shard=2, replace=True)
    plain = _train(m, _cfg(dp=4, dp_shard=2, zero=zero))
    exact = _train(m, _cfg(dp=4, dp_shard=2, zero=zero, **FULL))
    _close(exact, plain, f"zero {zero}: full-rank PowerSGD vs plain hybrid")
    low = _train(m, _cfg(dp=4, dp_shard=2, zero=zero, **LOW))
    return plain["ledger"], low["ledger"], low["plan"], low["shard"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_powersgd_under_2x2_hybrid_is_exact_at_full_rank_and_counted(zero):
    for plain, low, plan, shard in run_distributed(_two_by_two, 4, zero, timeout_s=300):
        shard_op = ("dp_shard", "all_reduce" if zero == 0 else "reduce_scatter")
        assert low[shard_op] == plain[shard_op]  # the shard group's reduction stays exact, uncompressed
        assert low[("dp_replicate", "all_reduce")] == plan["dp_replicate/all_reduce"], (low, plan)
        assert plan[f"{shard_op[0]}/{shard_op[1]}"] == low[shard_op]
        assert low[("dp_replicate", "all_reduce")] < plain[("dp_replicate", "all_reduce")]
