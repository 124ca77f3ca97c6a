"""Muon through the real train step at the layouts the issue names (slow tier): pipeline stages, ZeRO-3,
expert parallelism (experts whole or split over tp), context parallelism, offloaded state, each against
the single process (same seed and data, Newton-Schulz in fp32): losses and every parameter to 1e-5."""
import math

import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.parameters import params as P
from megalite.testing import assert_tensor_close, run_distributed
from muon_helpers import run_cfg, train_cfg

STEPS = 3
LAYOUTS = {  # name: (mesh sizes, settings)
    "pp2 dp2 zero1": (dict(pp=2), dict(pp=2, dp=2, zero=1)),
    "tp2 dp2 zero3 sp": (dict(tp=2), dict(tp=2, dp=2, zero=3, sequence_parallel=True)),
    "dp4 ep2 zero1": (dict(ep=2), dict(dp=4, ep=2, zero=1)),
    "tp2 dp2 ep2 etp1 zero2": (dict(tp=2, ep=2, etp=1), dict(tp=2, dp=2, ep=2, etp=1, zero=2)),
    "tp2 dp2 ep2 etp2 zero1": (dict(tp=2, ep=2, etp=2), dict(tp=2, dp=2, ep=2, etp=2, zero=1)),
    "cp2 dp2 zero1": (dict(cp=2), dict(cp=2, dp=2, zero=1)),
    "dp4 zero1 offload round-robin": (dict(), dict(dp=4, zero=1, offload_optimizer=True, muon_owners="round-robin")),
}
# PowerSGD at full rank: Muon updates whatever gradient the wrapper hands it. Its factorisation adds a
# ~1e-6 relative error to every gradient, which Newton-Schulz amplifies to ~5e-5 in the parameters over 3
# steps (measured), so this layout is held to the losses, as tests/moe/test_moe_powersgd.py holds PowerSGD.
POWERSGD = (dict(), dict(dp=4, zero=1, grad_compression="powersgd", powersgd_rank=10_000, powersgd_min_compression=0.0))


def _experts(cfg) -> int:
    """The model's experts, which the mesh's expert groups are built for (0: a dense model)."""
    moe = cfg.gpt_config().moe
    return moe.num_experts if moe is not None else 0


def _world(names):
    out = {}
    for name in names:
        sizes, settings = LAYOUTS[name] if name in LAYOUTS else POWERSGD
        cfg = run_cfg(**settings)
        m = mesh_lib.init_mesh(**sizes, num_experts=_experts(cfg), replace=True)
        losses, params, _ = train_cfg(m, cfg, STEPS)
        out[name] = (losses, {n: (spec, t.numpy()) for n, (spec, t) in params.items()})
    return out


@pytest.fixture(scope="module")
def single():
    losses, params, optimizer = train_cfg(mesh_lib.single_process_mesh(), run_cfg(), STEPS)
    assert optimizer.muon is not None and len(optimizer.muon.matrices) == 2 * (2 + 2 * 4)  # qkv, proj, 4 experts x 2
    return losses, {n: spec.assemble([t]) for n, (spec, t) in params.items()}


@pytest.mark.slow
def test_muon_layouts_equal_the_single_process(single):
    ref_losses, ref_full = single
    per_rank = run_distributed(_world, 4, list(LAYOUTS) + ["powersgd"], timeout_s=600)
    for rank, runs in enumerate(per_rank):
        torch.testing.assert_close(runs.pop("powersgd")[0], ref_losses, rtol=1e-5, atol=0)
    for rank, runs in enumerate(per_rank):
        for name, (losses, params) in runs.items():
            for a, b in zip(losses, ref_losses):
                if a is not None:
                    assert math.isclose(a, b, rel_tol=1e-5), (name, rank, losses, ref_losses)
            for n, (spec, value) in params.items():
                assert_tensor_close(torch.from_numpy(value), spec.shard(ref_full[n]), rtol=1e-5,
                                    what=f"{name} rank {rank} {n}")


def _resume_world(ckpt_dir):
    """2 steps at (dp 4, ep 2, ZeRO 2), saved; loaded at (tp 2, dp 2, ZeRO 3, SP): 2 more steps."""
    from megalite.checkpoint import Checkpointer, load_checkpoint
    from muon_helpers import cfg_batches
    from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step
    quiet = dict(log=lambda *_: None)
    cfg = run_cfg(dp=4, ep=2, zero=2)
    m = mesh_lib.init_mesh(dp=4, ep=2, num_experts=_experts(cfg), replace=True)
    _, _, optimizer = train_cfg(m, cfg, 2)
    chunks = optimizer.model.chunks
    Checkpointer(ckpt_dir, m, **quiet).save(2, list(chunks), optimizer, consumed_samples=16,
                                            model_config=chunks[0].config)
    cfg = run_cfg(tp=2, dp=2, zero=3, sequence_parallel=True)
    m = mesh_lib.init_mesh(tp=2, num_experts=_experts(cfg), replace=True)
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    load_checkpoint(ckpt_dir, chunks, optimizer, m, **quiet)
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, None).loss
              for mbs in cfg_batches(cfg, m.dp_size, m.dp_rank, 4)[2:]]
    with optimizer.model.gathered():
        params = {n: (P.shard_spec(p), p.detach().float().clone().numpy()) for c in chunks
                  for n, p in c.logical_parameters()}
    return losses, params


@pytest.mark.slow
def test_a_muon_run_resumes_at_another_layout(tmp_path):
    ref_losses, _, optimizer = train_cfg(mesh_lib.single_process_mesh(), run_cfg(), 4)
    with optimizer.model.gathered():
        ref_full = {n: P.shard_spec(p).assemble([p.detach().float()]) for c in optimizer.model.chunks
                    for n, p in c.logical_parameters()}
    for rank, (losses, params) in enumerate(run_distributed(_resume_world, 4, str(tmp_path / "ckpt"), timeout_s=600)):
        torch.testing.assert_close(losses, ref_losses[2:], rtol=1e-5, atol=0)
        for n, (spec, value) in params.items():
            assert_tensor_close(torch.from_numpy(value), spec.shard(ref_full[n]), rtol=1e-5, what=f"rank {rank} {n}")
