"""Hybrid sharding (--dp-shard S): ZeRO over groups of S dp ranks, replicated across the dp/S groups.

Oracle: the single-process run (float32, same seed and global batches); at every ZeRO stage the
hybrid layouts' losses and final parameters match it to 1e-5 relative, as flat dp does. clip_grad
0.5 clips every step, so a grad norm that counted a replicated shard twice would change the update.
Exact: the bytes per group of one step, from the ledger (the shard group reduce-scatters the whole
buffer and gathers it; only the rank's 1/S shard crosses the replica group; nothing is reduced or
gathered over all of dp), and the planner's count of them (megalite/plan/communication.py).
"""
import pytest
import torch

from megalite.distributed import comm, mesh as mesh_lib, topology
from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.layout import Layout, LayoutError
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.plan import communication_bytes
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.loop import main
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, GLOBAL, SEQ = 2, 8, 16


def _model():
    return preset("tiny", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ)


def _cfg(tp=1, dp=1, **kw):
    return RunConfig.build(tp=tp, dp=dp, micro_batch_size=2, global_batch_size=GLOBAL, lr=1e-3, weight_decay=0.1,
                           clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _batches(vocab, dp, dp_rank):
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, :3 + step] = -100  # uneven target counts across ranks
        mine = slice(dp_rank * GLOBAL // dp, (dp_rank + 1) * GLOBAL // dp)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(2), labels[mine].split(2))])
    return out


def _train(m, cfg, ref_params=None):
    """Train STEPS steps; check the final parameters against `ref_params`; return the losses, grad norms,
    the last step's bytes per (group, op) and the layout's sizes."""
    chunks = build_model_chunks(_model(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    dp, results = optimizer.model, []
    for mbs in _batches(chunks[0].config.vocab_size, m.dp_size, m.dp_rank):
        comm.ledger.reset()
        results.append(train_step(dp, optimizer, mbs, m, cfg, lr=1e-3))
    ledger = {key: n for key, n in comm.ledger.bytes.items() if key[1] != "all_reduce" or n > 8}  # not the counts
    with dp.gathered():
        params = {n: (P.shard_spec(p), p.detach().clone()) for c in chunks for n, p in c.logical_parameters()}
    if ref_params is not None:  # full tensors, or (spec, this rank's local tensor) of the same layout
        for name, (spec, value) in params.items():
            expected = ref_params[name][1] if isinstance(ref_params[name], tuple) else spec.shard(ref_params[name])
            assert_tensor_close(value, expected, rtol=1e-5, what=f"{cfg.parallel} {name}")
    plan = communication_bytes(_model(), cfg, m.pp_rank)  # the planner's bytes of the same step
    return dict(losses=[r.loss for r in results], norms=[r.grad_norm for r in results], ledger=ledger, plan=plan,
                numel=dp.layout.numel, shard=dp.layout.shard_numel, params=None if ref_params is not None else params)


@pytest.fixture(scope="module")
def reference():
    r = _train(single_process_mesh("cpu"), _cfg())
    return r["losses"], r["norms"], {n: spec.assemble([p]) for n, (spec, p) in r["params"].items()}


def _expected_bytes(zero, numel, shard, shard_group, replicas):
    """{(group, op): bytes} of one step's gradient reduction and parameter gather (fp32, one microbatch
    per rank at dp 4; ZeRO-3 reduces per microbatch and gathers each unit twice: forward and backward)."""
    out = {}
    if zero == 0:
        out[("dp_shard", "all_reduce")] = 4 * numel
    elif zero in (1, 2):
        out[("dp_shard", "reduce_scatter")] = 4 * numel
        out[("dp_shard", "all_gather")] = 4 * numel
    if zero > 0:
        out[("dp_replicate", "all_reduce")] = 4 * shard
    else:
        out[("dp_replicate", "all_reduce")] = 4 * numel
    return {k: v for k, v in out.items() if not (k[0] == "dp_shard" and shard_group == 1)}


# ------------------------------------------------------------------------------ the rank arithmetic


def test_shard_and_replicate_groups_tile_dp_cp():
    """dp 4 = 2 x 2 under tp 2, cp 2: shard groups are S consecutive dp ranks x cp, replica groups the
    ranks holding the same shard; together they tile every dp x cp group."""
    tp, pp, dp, cp, s = 2, 1, 4, 2, 2
    shards, replicas = topology.dp_shard_group_ranks(tp, pp, dp, cp, s), topology.dp_replicate_group_ranks(
        tp, pp, dp, cp, s)
    assert shards[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert replicas[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    for members in topology.dp_cp_group_ranks(tp, pp, dp, cp):
        mine = [g for g in shards if g[0] in members]
        assert sorted(r for g in mine for r in g) == members and len(mine) == dp // s
        assert all(len({topology.rank_to_coords(r, tp, pp, dp, cp)[1] // s for r in g}) == 1 for g in mine)
    for g in replicas:  # same tp rank, cp rank and dp_rank % S: the same shard in every replica group
        coords = {(r % tp, topology.rank_to_cp_rank(r, tp, cp), topology.rank_to_coords(r, tp, pp, dp, cp)[1] % s)
                  for r in g}
        assert len(coords) == 1 and len(g) == dp // s
    assert topology.dp_shard_group_ranks(tp, pp, dp, cp) == topology.dp_cp_group_ranks(tp, pp, dp, cp)
    # experts: an expert shard group is the expert-dp members of one replica group
    assert topology.expert_dp_shard_group_ranks(2, 1, 4, 1, 2, 1, 2) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    with pytest.raises(LayoutError, match="does not divide dp = 4"):
        Layout(dp=4, dp_shard=3)
    with pytest.raises(LayoutError, match="--ep 4 does not divide dp_shard"):
        Layout(dp=4, dp_shard=2, ep=4, num_experts=4)


@pytest.mark.parametrize("kw, needle", [
    (dict(dp=4, dp_shard=3), "--dp-shard 3 does not divide dp = 4"),
    (dict(dp=4, num_distributed_optimizer_instances=3), "--num-distributed-optimizer-instances 3 does not divide"),
    (dict(dp=4, dp_shard=2, num_distributed_optimizer_instances=2), "say the same thing twice"),
])
def test_bad_dp_shard_is_one_line(kw, needle):
    problems = _cfg(**kw).validate()
    assert len(problems) == 1 and needle in problems[0], problems


def _main_err(argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_a_dp_shard_that_does_not_divide_dp_is_one_line_exit_2():
    code, err = run_distributed(_main_err, 1, ["--dp-shard", "3", "--train-iters", "1"], timeout_s=120)[0]
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--dp-shard 3 does not divide dp = 1" in err, err


@pytest.mark.slow
def test_the_training_program_runs_hybrid(tmp_path):
    """The loop's mesh takes --dp-shard (Megatron's spelling here): dp 2 as 2 replicas of S = 1 at ZeRO 1."""
    argv = ["--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "2", "--eval-iters", "0", "--use-distributed-optimizer",
            "--num-distributed-optimizer-instances", "2"]
    assert [code for code, _ in run_distributed(_main_err, 2, argv, timeout_s=120)] == [0, 0]


def test_megatron_instances_are_dp_over_s():
    assert _cfg(dp=8, num_distributed_optimizer_instances=2).dp_shard == 4
    assert _cfg(dp=8, dp_shard=2).dp_shard == 2 and _cfg(dp=8).dp_shard == 8


# ------------------------------------------------------------------------------ worlds


def _world(refs, zeros, tp=1, dp_shard=1, sequence_parallel=False):
    """Hybrid runs checked against the one-process parameters; under tp against flat dp's own (at tp 2 this
    tiny model's tp rank 1 fc1.bias is 1.5e-5 from the one-process run at flat dp too: Adam's update of a
    32-element shard of near-zero gradients; hybrid is 1.3e-5 from it and 2e-6 from flat dp)."""
    ref = refs[2]
    if tp > 1:
        flat = mesh_lib.init_mesh(tp=tp)
        ref = {zero: _train(flat, _cfg(zero=zero, tp=tp, dp=flat.dp_size, sequence_parallel=sequence_parallel)
                            )["params"] for zero in zeros}
    m = mesh_lib.init_mesh(tp=tp, dp_shard=dp_shard, replace=True)
    assert (m.dp_shard_size, m.dp_replicate_size) == (dp_shard, m.dp_size // dp_shard)
    kw = dict(tp=tp, dp=m.dp_size, dp_shard=dp_shard, sequence_parallel=sequence_parallel)
    return {zero: _train(m, _cfg(zero=zero, **kw), ref if tp == 1 else ref[zero]) for zero in zeros}


def _check(per_rank, reference, dp_shard):
    for runs in per_rank:
        for zero, run in runs.items():
            torch.testing.assert_close(run["losses"], reference[0], rtol=1e-5, atol=0, msg=lambda s: f"zero {zero}: {s}")
            torch.testing.assert_close(run["norms"], reference[1], rtol=1e-5, atol=0, msg=lambda s: f"zero {zero}: {s}")
            assert min(run["norms"]) > 0.5  # clipping is on in every step: the norm decides the update
            for (group, op), n in run["ledger"].items():  # the planner counts what ran (padding aside)
                if group in ("dp_shard", "dp_replicate"):
                    assert abs(run["plan"][f"{group}/{op}"] - n) <= 1e-3 * n, (zero, group, op, run["plan"], n)
            assert not {k for k in run["plan"] if k.startswith(("dp/", "dp_cp/"))}, run["plan"]
            if zero == 3:  # per microbatch reduce-scatters and gathers in the shard group; the step's shard
                assert run["ledger"][("dp_replicate", "all_reduce")] == 4 * run["shard"]  # crosses replicas once
                assert ("dp", "reduce_scatter") not in run["ledger"] and ("dp", "all_gather") not in run["ledger"]
                continue
            wanted = _expected_bytes(zero, run["numel"], run["shard"], dp_shard, 2)
            grad_and_params = {k: v for k, v in run["ledger"].items() if k[0] in ("dp_shard", "dp_replicate", "dp")}
            assert grad_and_params == wanted, (zero, grad_and_params, wanted)


def test_dp2_as_two_replicas_of_one_shard_matches_one_process(reference):
    """dp 2 at S = 1: every rank holds the whole (sharded-over-one) state; the replica all-reduce is the
    whole reduction. ZeRO 1 and 3 (the two code paths: bucketed and per unit)."""
    _check(run_distributed(_world, 2, reference, (1, 3), timeout_s=120), reference, 1)


@pytest.mark.slow
def test_dp4_as_2x2_matches_one_process_at_every_zero_stage(reference):
    _check(run_distributed(_world, 4, reference, (0, 1, 2, 3), dp_shard=2, timeout_s=240), reference, 2)


@pytest.mark.slow
def test_tp2_dp4_as_2x2_matches_one_process(reference):
    per_rank = run_distributed(_world, 8, reference, (1, 3), tp=2, dp_shard=2, sequence_parallel=True, timeout_s=300)
    _check(per_rank, reference, 2)


# ------------------------------------------------------------------------------ composition: against flat dp


def _moe_model():
    return preset("tiny-llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, seq_length=SEQ, moe=dict(num_experts=4, topk=2, ffn_hidden_size=32))


def _versus_flat(cases):
    """Each case (name, layout, settings, dp_shard) trained flat and then hybrid in this world: the same
    losses and every parameter to 1e-5 relative."""
    out = {}
    for name, layout, settings, dp_shard in cases:
        runs = []
        for s in (None, dp_shard):
            model = _moe_model() if layout.get("ep", 1) > 1 else _model()
            experts = model.moe.num_experts if model.moe is not None else 0
            m = mesh_lib.init_mesh(**layout, dp_shard=s, num_experts=experts, replace=True)
            cfg = _cfg(**{k: v for k, v in layout.items() if k != "etp"}, dp=m.dp_size, dp_shard=s, **settings)
            chunks = build_model_chunks(model, cfg, m)
            optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
            losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss
                      for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank)]
            with optimizer.model.gathered():
                params = {n: p.detach().clone() for c in chunks for n, p in c.logical_parameters()}
            runs.append((losses, params))
        (flat_losses, flat), (losses, hybrid) = runs
        torch.testing.assert_close(losses, flat_losses, rtol=1e-5, atol=0, msg=lambda s: f"{name}: {s}")
        for key, value in hybrid.items():
            assert_tensor_close(value, flat[key], rtol=1e-5, what=f"{name} {key}")
        out[name] = losses
    return out


@pytest.mark.slow
def test_hybrid_composes_with_pipeline_context_experts_and_overlap():
    """pp 2 and cp 2 (dp 2 as 2 replicas of S = 1), the experts' own shard groups (ep 2 at dp 4 as 2 x 2),
    overlapped parameter gathers: each equals flat dp."""
    cases = [("pp2 zero1", dict(pp=2), dict(zero=1), 1), ("pp2 zero3", dict(pp=2), dict(zero=3), 1),
             ("cp2 zero2", dict(cp=2), dict(zero=2), 1), ("cp2 zero3", dict(cp=2), dict(zero=3), 1),
             ("dp4 overlap", {}, dict(zero=1, overlap_param_gather=True), 2),
             ("ep2 zero1", dict(ep=2, etp=1), dict(zero=1), 2), ("ep2 zero3", dict(ep=2, etp=1), dict(zero=3), 2)]
    run_distributed(_versus_flat, 4, cases, timeout_s=300)
