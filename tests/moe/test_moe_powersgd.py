"""PowerSGD with MoE experts reduced over their own replica group (expert-dp), in one 4-rank world.

- Full rank (every matrix compressed at r' = min(n, m), nothing lost) equals the uncompressed single
  process, per-step loss and grad norm, at (dp 4, ep 2) ZeRO 1 (dense factors over 4 ranks, the
  experts' over their 2 replicas) and at (tp 2, dp 2, ep 2, etp 1) SP (dense over dp 2, the whole
  experts over the 2 tp ranks): a factor summed over the wrong group adds another rank's
  gradient (other experts, or nothing of the experts' tp peer) and fails this.
- Those runs' dp and edp bytes are the planner's (each a P-then-Q pair), their compressor state is
  the planner's, and the planner's shapes are the parameters'. At (dp 4, ep 4) each expert has one
  replica: nothing of it is reduced or compressed (a full-rank step still equals the reference).
- At rank 4 the run depends on each group's replicas only through their sum (powersgd.py), so a
  checkpoint of (dp 4, ep 2) ZeRO 1 (compressed: not the uncompressed run) resumes at (dp 4, ep 1)
  ZeRO 0, where the experts reduce with the dense gradients over all 4 ranks, with the
  uninterrupted losses: each dense replica reads its own share, an expert's 2 stored shares
  arrive summed on replica 0 (zero elsewhere).
"""
import pytest
import torch

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.plan.communication import communication_bytes
from megalite.plan.compression import compression_state_bytes, stage_expert_shapes, stage_param_shapes
from megalite.plan.moe import moe_replica_bytes
from megalite.testing import run_distributed
from moe_helpers import cfg_for, train

FULL_RANK = dict(grad_compression="powersgd", powersgd_rank=10_000, powersgd_min_compression=0.0)
RANK4 = dict(grad_compression="powersgd", powersgd_rank=4, powersgd_warmup_steps=1)
QUIET = dict(log=lambda *_: None)


def _run(m, cfg, steps, chunks=None, optimizer=None, ledgers=None):
    """Train `steps` one at a time, keeping each step's ledger."""
    results = []
    for step in steps:
        chunks, optimizer, result = train(m, cfg, range(step, step + 1), chunks, optimizer)
        results += result
        if ledgers is not None:
            ledgers.append(dict(comm.ledger.bytes))
    return chunks, optimizer, results


def _check_plan(m, cfg, optimizer, ledgers, results):
    """Every compressed step's dp and edp all-reduces are the planner's (+ on dp the 8-byte token count;
    the MoE metrics, per layer E route counts and 4 sums in float64, are the planner's too), nothing is
    reduce-scattered; the state and the parameter shapes are the planner's."""
    model, stage = cfg.gpt_config(), m.pp_rank
    planned = communication_bytes(model, cfg, stage)
    others = 8  # the token count: a step scalar (step_scalar_collectives), not in communication_bytes
    metrics = moe_replica_bytes(model, cfg, stage)
    assert metrics == 8 * (model.moe.num_experts + 4) * model.num_layers  # every layer is an MoE block here
    shapes = sorted(tuple(p.shape) for p in optimizer.model.params)
    assert shapes == sorted(stage_param_shapes(model, cfg, stage) + stage_expert_shapes(model, cfg, stage))
    assert optimizer.model.compression.state_bytes() == compression_state_bytes(model, cfg, stage)
    dense = "dp" if m.dp_size > 1 else None
    for ledger, result in zip(ledgers, results):
        assert ledger[("edp", "all_reduce")] == planned["edp/all_reduce"] > 0
        assert ("edp", "reduce_scatter") not in ledger and ("dp", "reduce_scatter") not in ledger
        if dense:
            assert ledger[("dp", "all_reduce")] == planned["dp/all_reduce"] + others
        sent = planned["edp/all_reduce"] + (planned["dp/all_reduce"] - metrics if dense else 0)  # gradients only
        assert result.grad_reduce_bytes == sent


def _state(optimizer):
    """{name: this rank's residual share} of every compressed parameter."""
    model, compressor = optimizer.model, optimizer.model.compression
    return {model.names[i]: compressor.error_of(i).clone() for i in compressor.matrices}


def _world(ckpt_dir):
    out = {}
    cfg = cfg_for(dp=4, ep=2, zero=1, **FULL_RANK)
    m = mesh_lib.init_mesh(layout=cfg.layout(), replace=True)
    assert cfg.validate() == []
    ledgers = []
    _, optimizer, results = _run(m, cfg, range(2), ledgers=ledgers)
    _check_plan(m, cfg, optimizer, ledgers, results)
    out["full_dp4_ep2"] = [(r.loss, r.grad_norm) for r in results]

    cfg = cfg_for(dp=4, ep=2, zero=1, **RANK4)
    chunks, optimizer, results = _run(m, cfg, range(2))
    Checkpointer(ckpt_dir, m, **QUIET).save(2, chunks, optimizer, consumed_samples=16, model_config=chunks[0].config)
    out["saved"] = _state(optimizer)
    out["rank4_dp4_ep2"] = [r.loss for r in results + _run(m, cfg, range(2, 4), chunks, optimizer)[2]]

    m = mesh_lib.init_mesh(dp=4, replace=True)
    cfg = cfg_for(dp=4, **RANK4)
    chunks, optimizer, _ = train(m, cfg, steps=range(0))
    load_checkpoint(ckpt_dir, chunks, optimizer, m, **QUIET)
    out["loaded"] = _state(optimizer)
    out["resumed"] = [r.loss for r in _run(m, cfg, range(2, 4), chunks, optimizer)[2]]

    cfg = cfg_for(dp=4, ep=4, **FULL_RANK)
    m = mesh_lib.init_mesh(layout=cfg.layout(), replace=True)  # expert-dp of one rank: the experts are neither reduced nor compressed
    _, optimizer, results = _run(m, cfg, range(1))
    names = [optimizer.model.names[i] for i in optimizer.model.compression.matrices]
    assert names and not any(".experts." in name for name in names) and ("edp", "all_reduce") not in comm.ledger.bytes
    assert optimizer.model.compression.state_bytes() == compression_state_bytes(cfg.gpt_config(), cfg, 0)
    out["full_dp4_ep4"] = [(r.loss, r.grad_norm) for r in results]

    cfg = cfg_for(tp=2, dp=2, ep=2, etp=1, zero=1, sequence_parallel=True, **FULL_RANK)
    m = mesh_lib.init_mesh(layout=cfg.layout(), replace=True)
    assert cfg.validate() == []
    ledgers = []
    _, optimizer, results = _run(m, cfg, range(2), ledgers=ledgers)
    _check_plan(m, cfg, optimizer, ledgers, results)
    out["full_tp2_etp1"] = [(r.loss, r.grad_norm) for r in results]
    return out


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_moe_powersgd_expert_group(tmp_path):
    _, _, results = train(single_process_mesh("cpu"), cfg_for(), steps=range(4))
    reference = [(r.loss, r.grad_norm) for r in results]
    plain = [loss for loss, _ in reference]
    reference = reference[:2]
    ranks = run_distributed(_world, 4, str(tmp_path / "ckpt"), timeout_s=300)
    first = ranks[0]
    torch.testing.assert_close(first["full_dp4_ep2"], reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(first["full_tp2_etp1"], reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(first["full_dp4_ep4"], reference[:1], rtol=1e-5, atol=0)
    rank4 = first["rank4_dp4_ep2"]
    torch.testing.assert_close(rank4[:1], plain[:1], rtol=1e-5, atol=0)  # the warm-up is plain
    assert abs(rank4[3] - plain[3]) > 1e-4 * plain[3]  # then compressed: another run
    torch.testing.assert_close(first["resumed"], rank4[2:], rtol=1e-5, atol=0)  # ep 1 continues ep 2's run
    experts = {name for rank in ranks for name in rank["saved"] if ".experts." in name}
    assert experts and experts <= set(ranks[0]["loaded"])
    for name in experts:  # dp 4, ep 2 stored 2 shares (the ranks holding it); dp 4, ep 1 sums them on rank 0
        shares = [rank["saved"][name] for rank in ranks if name in rank["saved"]]
        assert len(shares) == 2 and shares[0].abs().max() > 0
        torch.testing.assert_close(ranks[0]["loaded"][name], sum(shares), rtol=1e-6, atol=1e-9, msg=name)
        assert all(not rank["loaded"][name].any() for rank in ranks[1:]), name
    for name, share in ranks[1]["saved"].items():  # a dense parameter: the same 4 replicas read their own
        if ".experts." not in name:
            assert torch.equal(ranks[1]["loaded"][name], share), name
