"""MoE training steps under every parallel layout equal the single-process model (fp32; dropless but one).

One forked world of 4 ranks runs each layout on a mesh of its own: (tp 2, ep 2, SP) with whole experts on each
tp rank (etp 1, the default: each tp rank routes its own tokens), (tp 2, ep 2) with experts split over tp (etp
2), a capacity factor at (tp 2, ep 2, etp 1, SP) and the expert bias at (tp 2, ep 2, etp 1, no SP), both with
a shared expert, against their own single-process models (the drops decided over the tp ranks' tokens
together, the bias stepped on the load of all of them), (tp 2, cp 2, ep 2, SP) at etp 1 (the router's
statistics over tp x cp), (tp 2, pp 2, SP) at etp 1 with ZeRO 1 and full recompute (each stage's experts
sharded over its tp ranks), (dp 4, ep 2) with ZeRO 1 (expert-dp groups of 2), (dp 4, ep 4) with the all-gather
dispatcher and ZeRO 2, (pp 2, ep 2) under 1F1B with full recompute, (tp 2, dp 2, ep 2, etp 2, SP) with ZeRO 1
and selective recompute and with full recompute, and ZeRO 3 at (tp 2, dp 2, etp 2), (tp 2, dp 2, ep 2) and
(dp 4, ep 2) (each MoE block's experts a unit of their own, sharded over the expert-dp group), and (cp 2, dp 2,
ep 2) with ZeRO 1 (each cp rank balances its share of the whole sequences' losses), and a capacity factor
under cp, at (cp 2, dp 2, ep 2) and, keeping the earliest tokens, at (tp 2, cp 2, ep 2, SP) etp 1 (the drops
decided over the microbatch's tokens in the single process's order, not per cp rank's zigzag chunks).
Every layout trains STEPS steps through `train_step` from the same seed
and data as the reference: every step's loss and global grad norm (clipping counts each expert
once) and every parameter after the last step must match (~1e-5 relative), and the experts' traffic
must be on the ep group (all-to-all or all-gather) and, with expert-dp > 1, their gradient on edp.
The planner's numbers are checked against the same runs: parameters per rank exactly, and the
dispatch bytes of the last step (all-gather: every rank's; all-to-all: the ranks' mean, since a
rank receives as many routes as the others send it), and the tp bytes of every tp layout (each rank's;
the experts' output all-reduce at etp = tp over the ranks' sum, for the same reason).
"""
import pytest
import torch

from megalite.training.launch_checks import launch_problems
from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.distributed.mesh import single_process_mesh
from megalite.plan.communication import communication_bytes
from megalite.plan.moe import expert_dp_config
from megalite.plan.params import stage_params
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.guards import check_replicas
from moe_helpers import STEPS, cfg_for, train

DROPPING = dict(moe_expert_capacity_factor=0.75)  # some routes over capacity (dropped by probability)
EARLIEST = dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position")  # the token order decides
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05)  # moves step 2's routing
SHARED = dict(moe_shared_expert_intermediate_size=32)  # a dense tp MLP over the whole sequence beside the experts
MODEL = tuple(EARLIEST) + tuple(BIAS) + tuple(SHARED)  # settings that change the model: each set has its reference


def _model_key(settings) -> tuple:
    return tuple(sorted((k, v) for k, v in settings.items() if k in MODEL))


@pytest.fixture(scope="module")
def reference():
    """{model settings: (losses, grad norms, final parameters, last step's metrics)} at one process."""
    out = {}
    for key in sorted({_model_key(settings) for _, settings in LAYOUTS}):
        m = single_process_mesh("cpu")
        chunks, _, results = train(m, cfg_for(**dict(key)))
        params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
        out[key] = [r.loss for r in results], [r.grad_norm for r in results], params, results[-1]
    return out


LAYOUTS = [  # (tp, pp, dp, ep), settings (etp: 1 unless given, whole experts on each tp rank)
    ((2, 1, 2, 2), dict(sequence_parallel=True)),
    ((2, 1, 2, 2), dict(etp=2)),
    ((2, 1, 2, 2), dict(sequence_parallel=True, **DROPPING, **SHARED)),  # etp 1: capacity over the tp ranks' tokens
    ((2, 1, 2, 2), dict(**BIAS, **SHARED)),  # etp 1 without SP; the expert bias steps on every tp rank's load
    ((1, 1, 4, 2), dict(zero=1)),
    ((1, 1, 4, 4), dict(zero=2, moe_token_dispatcher_type="allgather")),
    ((1, 2, 2, 2), dict(recompute="full")),
    ((2, 1, 2, 2), dict(zero=1, recompute="selective", etp=2, sequence_parallel=True)),
    ((2, 1, 2, 1), dict(zero=3, etp=2)),
    ((2, 1, 2, 2), dict(zero=3)),
    ((1, 1, 4, 2), dict(zero=3, moe_token_dispatcher_type="allgather")),
    ((1, 1, 2, 2), dict(cp=2, zero=1)),
    ((2, 1, 1, 2), dict(cp=2, sequence_parallel=True)),  # etp 1: a microbatch's tokens over tp x cp
    ((2, 2, 1, 1), dict(sequence_parallel=True, zero=1, recompute="full")),  # etp 1: each stage's experts over its tp
    ((2, 1, 2, 2), dict(etp=2, sequence_parallel=True, recompute="full")),  # the rerun gathers and all-reduces again
    ((1, 1, 2, 2), dict(cp=2, **DROPPING)),  # capacity over the cp ranks' zigzag chunks, in sequence order
    ((2, 1, 1, 2), dict(cp=2, sequence_parallel=True, **EARLIEST)),  # etp 1: over tp x cp, earliest tokens kept
]


def _world(reference):
    checked = []
    for (tp, pp, dp, ep), settings in LAYOUTS:
        ref_losses, ref_norms, ref_params, _ = reference[_model_key(settings)]
        cfg = cfg_for(tp, pp, dp, ep, **settings)
        m = mesh.init_mesh(layout=cfg.layout(), replace=True)
        assert launch_problems(cfg.resolved(4), 4) == []
        what = f"tp={tp} pp={pp} dp={dp} ep={ep} {settings}"
        chunks, optimizer, results = train(m, cfg)
        ledger = dict(comm.ledger.bytes)  # the last step's (check_replicas below gathers over tp)
        torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=1e-5, atol=0, msg=what)
        torch.testing.assert_close([r.grad_norm for r in results], ref_norms, rtol=1e-5, atol=0, msg=what)
        with optimizer.model.gathered():
            for chunk in chunks:
                for logical, p in chunk.logical_parameters():
                    assert_tensor_close(p, P.shard_spec(p).shard(ref_params[logical]), rtol=1e-5,
                                        what=f"{what} {logical}")
        if cfg.parallel.zero == 3:  # replicas agree (experts compared over expert-dp only)
            check_replicas(optimizer.model.tp_replicated_pieces(), m, STEPS, shards=True)
        else:
            check_replicas([(n, p) for c in chunks for n, p in c.logical_parameters()], m, STEPS)
        stats = results[-1].moe
        planned = communication_bytes(cfg.gpt_config(), cfg, m.pp_rank)
        dispatch = {k: (ledger.get(tuple(k.split("/")), 0), n) for k, n in planned.items()
                    if k.startswith("ep/")}  # the last step's bytes: measured and planned
        tensor_parallel = {k: (ledger.get(tuple(k.split("/")), 0), planned.get(k, 0))
                           for k in {f"{g}/{op}" for g, op in ledger} | set(planned)
                           if k.split("/")[0] in ("tp", "tp_cp") or k == "cp/all_gather"}  # cp: capacity
        assert sum(p.numel() for p in optimizer.model.params) == stage_params(cfg.gpt_config(), cfg, m.pp_rank), what
        assert expert_dp_config(cfg).dp == comm.group_size(m.expert_dp_group), what  # the experts' ZeRO replicas
        checked.append(((tp, pp, dp, ep), settings, sorted(f"{g}/{op}" for g, op in ledger if
                                                           g in ("ep", "edp")), stats, dispatch, tensor_parallel))
    return checked


@pytest.mark.slow
def test_moe_layouts_match_the_single_process_model(reference):
    ref_losses, _, _, ref_last = reference[()]
    assert ref_losses[-1] < ref_losses[0] + 0.5 and ref_last.moe["moe_aux_loss"] > 0 and ref_last.moe["moe_z_loss"] > 0
    for dropping in ({**DROPPING, **SHARED}, DROPPING, EARLIEST):  # the capacity bites
        assert reference[_model_key(dropping)][3].moe["moe_dropped_tokens"] > 0, dropping
    ranks = run_distributed(_world, 4, reference, timeout_s=300)
    for i, ((tp, pp, dp, ep), settings) in enumerate(LAYOUTS):  # the planner's dispatch bytes: each rank's
        if "moe_expert_capacity_factor" in settings:
            continue  # the planner counts every route (dropless)
        dispatch = [rank[i][4] for rank in ranks]  # all-gather (same on every rank), all-to-all's mean over ranks
        for key in dispatch[0]:
            measured, planned = [d[key][0] for d in dispatch], dispatch[0][key][1]
            if key == "ep/all_to_all":  # a rank sends its routes, receives what others route to it
                assert sum(measured) == len(ranks) * planned, (key, measured, planned, settings)
            else:
                assert measured == [planned] * len(ranks), (key, measured, planned, settings)
        assert bool(dispatch[0]) == (ep > 1)
    _check_tensor_parallel_bytes(ranks)
    for checked in ranks:
        assert len(checked) == len(LAYOUTS)
        for (tp, pp, dp, ep), settings, groups, stats, _, _ in checked:
            ref_last = reference[_model_key(settings)][3]
            if ep > 1:  # the tokens travelled over the ep group
                dispatch = "all_gather" if settings.get("moe_token_dispatcher_type") == "allgather" else "all_to_all"
                assert f"ep/{dispatch}" in groups, (tp, pp, dp, ep, groups)
            if ep > 1 and dp // ep > 1:  # expert gradients reduced over the expert-data-parallel group
                assert any(g.startswith("edp/") for g in groups), groups
            # the metrics are the step's, over every replica: the same as the reference's
            for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
                assert stats[key] == pytest.approx(ref_last.moe[key], rel=1e-5), (key, settings)
            assert stats["moe_dropped_tokens"] == ref_last.moe["moe_dropped_tokens"], settings


def _check_tensor_parallel_bytes(ranks):
    """The planner's tp bytes (MoE blocks as layer.py runs them, at etp 1 and tp, with and without SP, a
    shared expert, a capacity factor, ZeRO-3, cp, full recompute) equal the ledger's last step, every
    rank's own; at etp = tp the experts' output all-reduce counts the routes a rank received, so there
    the all-reduce is compared over the ranks' sum (each rank plans the mean, T*k routes)."""
    for i, ((tp, pp, dp, ep), settings) in enumerate(LAYOUTS):
        per_rank = [rank[i][5] for rank in ranks]
        assert bool(per_rank[0]) == (tp > 1 or settings.get("cp", 1) > 1 and "moe_expert_capacity_factor" in settings)
        for key in set().union(*per_rank):
            measured, planned = [r.get(key, (0, 0))[0] for r in per_rank], [r.get(key, (0, 0))[1] for r in per_rank]
            if key == "tp/all_reduce" and settings.get("etp", 1) == tp and ep > 1:
                assert sum(measured) == sum(planned), (key, measured, planned, settings)
            else:
                assert measured == planned, (key, measured, planned, settings)
