"""Muon composed with hybrid sharding (--dp-shard S < dp) and as DiLoCo's inner optimizer.

Hybrid sharding: the owners gather whole matrices within their shard group (WholeMatrices over the
wrapper's shard group), every replica group orthogonalising its own copy of the reduced momentum; equal to
the single process (losses and every parameter to 1e-5, Newton-Schulz in fp32). DiLoCo with one replica
group (outer lr 1, no outer momentum): bit for bit the plain Muon run at the same layout, the outer step
included. Quick: 2 ranks as two replica groups of one rank (S = 1). Slow: dp 4 as 2 x S = 2 at ZeRO 1 and 3, dense
and with experts (ep 2); DiLoCo over one replica group of 4 against the plain run, and over two groups."""
import math

import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.testing import assert_tensor_close, run_distributed
from muon_helpers import run_cfg, train_cfg

STEPS = 3


def _run(cfg):
    m = mesh_lib.init_mesh(layout=cfg.layout(world_size=cfg.world_size), replace=True)
    losses, params, _ = train_cfg(m, cfg, STEPS)
    return losses, {n: (spec, t.numpy()) for n, (spec, t) in params.items()}


def _world(layouts):
    out = {}
    for name, settings in layouts.items():
        out[name] = _run(run_cfg(**settings))
    return out


def _single(dense: bool):
    losses, params, _ = train_cfg(mesh_lib.single_process_mesh(), run_cfg(dense=dense), STEPS)
    return losses, {n: spec.assemble([t]) for n, (spec, t) in params.items()}


def _assert_equal_to(reference, runs):
    ref_losses, ref_full = reference
    for name, (losses, params) in runs.items():
        for a, b in zip(losses, ref_losses):
            assert math.isclose(a, b, rel_tol=1e-5), (name, losses, ref_losses)
        for n, (spec, value) in params.items():
            assert_tensor_close(torch.from_numpy(value), spec.shard(ref_full[n]), rtol=1e-5, what=f"{name} {n}")


DILOCO = dict(diloco_inner_steps=2, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)


def test_muon_under_hybrid_sharding_with_two_replica_groups():
    per_rank = run_distributed(_world, 2, {"hybrid S1 zero1": dict(dense=True, dp=2, dp_shard=1, zero=1)}, timeout_s=600)
    reference = _single(dense=True)
    for runs in per_rank:
        _assert_equal_to(reference, runs)


def _assert_diloco_is_plain(runs: dict, plain: str, diloco: str) -> None:
    """One replica group, outer lr 1, no momentum: the DiLoCo run is the plain one bit for bit."""
    (plain_losses, plain_params), (losses, params) = runs.pop(plain), runs.pop(diloco)
    assert losses == plain_losses, (losses, plain_losses)
    for n, (_, value) in plain_params.items():
        assert (params[n][1] == value).all(), n  # every parameter, after the outer step too


@pytest.mark.slow
def test_muon_under_hybrid_sharding_and_as_dilocos_inner_optimizer():
    layouts = {f"dp4 S2 zero{zero}": dict(dense=True, dp=4, dp_shard=2, zero=zero) for zero in (1, 3)}
    layouts["dp4 S2 ep2 zero1"] = dict(dp=4, dp_shard=2, ep=2, zero=1)
    layouts["dp4 zero2"] = dict(dense=True, dp=4, zero=2)
    layouts["dp4 zero2 diloco"] = dict(dense=True, dp=4, zero=2, **DILOCO)  # one replica group of 4
    layouts["dp4 S2 zero1 diloco"] = dict(dense=True, dp=4, dp_shard=2, zero=1, **DILOCO)  # two: runs, not compared
    per_rank = run_distributed(_world, 4, layouts, timeout_s=900)
    dense, moe = _single(dense=True), _single(dense=False)
    for runs in per_rank:
        _assert_diloco_is_plain(runs, "dp4 zero2", "dp4 zero2 diloco")
        assert all(math.isfinite(x) for x in runs.pop("dp4 S2 zero1 diloco")[0])
        _assert_equal_to(moe, {"dp4 S2 ep2 zero1": runs.pop("dp4 S2 ep2 zero1")})
        _assert_equal_to(dense, runs)
