"""ZeRO-3: the same training as ZeRO-0, with parameters sharded unit by unit.

Oracle: the single-process run in this process (float32, same seed and global batches); every
layout's losses and final parameters must match it to ~1e-5 relative. Inside each started
world several runs share the processes. Also exact: bytes per rank (shard-sized parameters,
gradients and two Adam moments: 16 bytes per element of the shard in fp32), the dp ledger
(3 Psi elements gathered/reduced per microbatch with reshard-after-forward, 2 Psi without,
Psi + m Psi when kept gathered through the step; GPT-2's tied head borrows the embedding
once more in forward and in backward), and the peak of gathered units. Asynchronous
gathers are tested the hard way: under `gathers_land_at_wait` any read before a gather's
wait() reads NaN, and the run must equal the unpoisoned one bit for bit.
"""
import contextlib

import pytest
import torch

from megalite.distributed import comm, mesh as mesh_lib
from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.plan import communication_bytes, estimate
from megalite.testing import assert_tensor_close, gathers_land_at_wait, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, GLOBAL, SEQ = 2, 8, 16


def _model(flavour):
    if flavour == "llama":
        return preset("tiny-llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, seq_length=SEQ)
    return preset("tiny", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ)


def _cfg(tp=1, pp=1, dp=1, micro=2, **kw):
    # adam_eps above float32 gradient noise: see tests/training/test_train_step.py
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=micro, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _batches(vocab, dp, dp_rank, micro):
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, :3 + step] = -100  # uneven target counts across ranks
        mine = slice(dp_rank * GLOBAL // dp, (dp_rank + 1) * GLOBAL // dp)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(micro), labels[mine].split(micro))])
    return out


def _train(flavour, m, cfg, ref_params=None, poisoned=False):
    """Train STEPS steps (checking the final parameters against `ref_params`, full tensors by
    logical name); returns losses, the last step's dp ledger and the parts of the accounting."""
    model = _model(flavour)
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    dp, results = optimizer.model, []
    with gathers_land_at_wait() if poisoned else contextlib.nullcontext():
        for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank, cfg.training.micro_batch_size):
            comm.ledger.reset()
            results.append(train_step(dp, optimizer, mbs, m, cfg, lr=1e-3))
    ledger = {op: n for (group, op), n in comm.ledger.bytes.items() if group == "dp"}
    memory = optimizer.memory_report()  # before gathering everything below
    with dp.gathered():
        params = {n: (P.shard_spec(p), p.detach().clone()) for c in chunks for n, p in c.logical_parameters()}
    if ref_params is not None:
        for name, (spec, value) in params.items():
            assert_tensor_close(value, spec.shard(ref_params[name]), rtol=1e-5, what=f"{cfg.parallel} {name}")
    plan = {}
    if cfg.parallel.zero == 3:  # the planner's view of the same run
        est = estimate(model, cfg)
        plan = dict(param_bytes=est.param_bytes, optimizer=est.optimizer_state_bytes,
                    comm=communication_bytes(model, cfg, m.pp_rank))
    return dict(losses=[r.loss for r in results], skipped=[r.skipped for r in results], plan=plan,
                scales=[r.loss_scale for r in results], params=params, ledger=ledger,
                memory=memory, shard=dp.layout.shard_numel,
                units=[b.numel for b in dp.layout.buckets], names=[u.name for u in dp.units])


@pytest.fixture(scope="module")
def reference():
    out = {}
    for flavour in ("gpt2", "llama"):
        r = _train(flavour, single_process_mesh("cpu"), _cfg())
        out[flavour] = (r["losses"], {n: spec.assemble([p]) for n, (spec, p) in r["params"].items()})
    return out


# ------------------------------------------------------------------------------ worlds


def _dp2_world(refs):
    m = mesh_lib.init_mesh()
    zero3 = dict(dp=2, zero=3)
    configs = {"zero3": _cfg(**zero3), "reshard off": _cfg(**zero3, zero3_reshard_after_forward=False),
               "keep, prefetch 2": _cfg(**zero3, zero3_keep_gathered_in_step=True, zero3_prefetch=2),
               "accumulation 4": _cfg(dp=2, micro=1, zero=3), "full recompute": _cfg(**zero3, recompute="full"),
               "offload": _cfg(**zero3, offload_optimizer=True)}
    runs = {("gpt2", what): _train("gpt2", m, cfg, refs["gpt2"][1]) for what, cfg in configs.items()}
    runs["gpt2", "poisoned"] = _train("gpt2", m, _cfg(**zero3), refs["gpt2"][1], poisoned=True)
    runs["llama", "zero3"] = _train("llama", m, _cfg(**zero3), refs["llama"][1])
    runs["llama", "poisoned, prefetch 0"] = _train("llama", m, _cfg(**zero3, zero3_prefetch=0), refs["llama"][1],
                                                    poisoned=True)
    # fp16: a loss scale that overflows; every stage must skip the same steps and leave the weights alone
    fp16 = dict(dp=2, precision="fp16", initial_loss_scale=2.0 ** 30, hysteresis=1)
    for zero in (0, 3):
        runs["gpt2", f"fp16 zero {zero}"] = _train("gpt2", m, _cfg(**fp16, zero=zero))
    for zero in (0, 3):  # bf16: ZeRO-3's shard is the fp32 master, cast to bf16 as it is gathered
        runs["gpt2", f"bf16 zero {zero}"] = _train("gpt2", m, _cfg(dp=2, precision="bf16", zero=zero))
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(runs["gpt2", "fp16 zero 0"]["params"].values(),
                                                           runs["gpt2", "fp16 zero 3"]["params"].values()))
    for run in runs.values():
        del run["params"]
    return runs, same


def test_zero3_at_dp2_matches_one_process(reference):
    for rank, (runs, fp16_same_params) in enumerate(run_distributed(_dp2_world, 2, reference, timeout_s=240)):
        for (flavour, what), run in runs.items():
            if what.startswith(("fp16", "bf16")):
                continue
            torch.testing.assert_close(run["losses"], reference[flavour][0], rtol=1e-5, atol=0,
                                       msg=lambda s: f"{flavour} {what}: {s}")
            assert not any(run["skipped"]), what
        # The gathered values are the same whatever the timing: bit-identical losses.
        for flavour, what in (("gpt2", "reshard off"), ("gpt2", "keep, prefetch 2"), ("gpt2", "poisoned"),
                              ("llama", "poisoned, prefetch 0")):
            assert runs[flavour, what]["losses"] == runs[flavour, "zero3"]["losses"], (flavour, what)
        for flavour in ("gpt2", "llama"):
            _check_accounting({w: r for (f, w), r in runs.items() if f == flavour}, flavour, dp=2, m=2)
        fp16 = runs["gpt2", "fp16 zero 0"], runs["gpt2", "fp16 zero 3"]
        assert fp16[0]["skipped"] == fp16[1]["skipped"] == [True] * STEPS, fp16
        assert fp16[0]["scales"] == fp16[1]["scales"] == [2.0 ** (30 - k) for k in range(STEPS)]
        assert fp16[0]["losses"] == fp16[1]["losses"] and fp16_same_params
        bf16 = runs["gpt2", "bf16 zero 0"], runs["gpt2", "bf16 zero 3"]
        assert bf16[0]["losses"][0] == bf16[1]["losses"][0]  # the same bf16 weights (RNE of the same master)
        torch.testing.assert_close(bf16[1]["losses"], bf16[0]["losses"], rtol=1e-3, atol=0)
        shard = bf16[1]["shard"]  # 16 bytes per parameter per dp rank in bf16 too: fp32 shard + grads + moments
        assert [bf16[1]["memory"][k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")] == \
            [4 * shard, 4 * shard, 8 * shard], bf16[1]["memory"]


def _build_peak_bytes(flavour, m, cfg):
    """Most bytes allocated at once while building a ZeRO-3 model (profiled), and the model's bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_data_parallel(build_model_chunks(_model(flavour), cfg, m), cfg, m)
    level = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        level += nbytes
        peak = max(peak, level)
    return peak, model.layout.shard_numel, max(b.numel for b in model.layout.buckets), model.layout.numel


def _dp4_world(refs):
    m = mesh_lib.init_mesh()
    runs = {f: _train(f, m, _cfg(dp=4, zero=3), refs[f][1]) for f in ("gpt2", "llama")}
    runs["build"] = _build_peak_bytes("llama", m, _cfg(dp=4, zero=3))
    return runs


def test_zero3_at_dp4_one_microbatch_moves_3_psi(reference):
    for runs in run_distributed(_dp4_world, 4, reference, timeout_s=240):
        # Built on the meta device and materialised one unit at a time: besides its fp32 parameter and
        # gradient shards a rank holds at most ~3 units' worth at once (a unit's full-weight init, its
        # tp shard, its gathered buffer before it is freed), never the whole model.
        peak, shard, largest_unit, numel = runs.pop("build")
        assert 0 < peak - 8 * shard <= 3 * 4 * largest_unit < 4 * numel, (peak, shard, largest_unit, numel)
        for flavour, run in runs.items():
            torch.testing.assert_close(run["losses"], reference[flavour][0], rtol=1e-5, atol=0)
            _check_accounting({"zero3": run}, flavour, dp=4, m=1)


def _model_parallel_world(refs, tp, pp, cp=1):
    """(tp 2, dp 2) with sequence parallelism, (cp 2, dp 2) (shards over dp x cp), or (pp 2, dp 2):
    1F1B, interleaved (re-gathered per microbatch, and kept through the step), ZB-H1 (reduced
    after each W pass)."""
    ref = refs["gpt2"][1]
    m = mesh_lib.init_mesh(tp=tp, pp=pp, cp=cp)
    if tp > 1:
        return {"tp2 sp": _train("gpt2", m, _cfg(tp=2, dp=2, zero=3, sequence_parallel=True), ref)}
    if cp > 1:
        return {"cp2": _train("gpt2", m, _cfg(dp=2, cp=2, zero=3), ref)}
    interleaved = dict(pp=2, dp=2, zero=3, virtual_stages=2, pipeline_schedule="interleaved")
    runs = {"pp2 1f1b": _train("gpt2", m, _cfg(pp=2, dp=2, zero=3), ref),
            "pp2 interleaved": _train("gpt2", m, _cfg(**interleaved), ref),
            "pp2 interleaved kept": _train("gpt2", m, _cfg(**interleaved, zero3_keep_gathered_in_step=True), ref),
            "pp2 zb-h1": _train("gpt2", m, _cfg(pp=2, dp=2, zero=3, pipeline_schedule="zb-h1"), ref)}
    for run in runs.values():
        del run["params"]
    return runs


@pytest.mark.slow  # 2.6 s; test_zero3_at_dp2_matches_one_process stays quick
def test_zero3_composes_with_tensor_context_and_pipeline_parallelism(reference):
    per_rank = run_distributed(_model_parallel_world, 4, reference, 2, 1, timeout_s=240)
    per_rank += run_distributed(_model_parallel_world, 4, reference, 1, 1, 2, timeout_s=240)
    per_rank += run_distributed(_model_parallel_world, 4, reference, 1, 2, timeout_s=240)
    for runs in per_rank:
        for what, run in runs.items():
            torch.testing.assert_close(run["losses"], reference["gpt2"][0], rtol=1e-5, atol=0,
                                       msg=lambda s: f"{what}: {s}")
        if "pp2 1f1b" not in runs:
            continue
        # per microbatch: each unit gathered for forward and for backward; kept: once per step
        for what in ("pp2 1f1b", "pp2 interleaved", "pp2 zb-h1"):
            psi, m, ledger = sum(runs[what]["units"]), 2, runs[what]["ledger"]
            assert ledger["all_gather"] == 4 * 2 * m * psi, (what, ledger, psi)
            if what == "pp2 zb-h1":  # a unit reduces after its W pass: what accumulated by then, <= once per mb
                assert 4 * psi <= ledger["reduce_scatter"] <= 4 * m * psi, (what, ledger, psi)
            else:
                assert ledger["reduce_scatter"] == 4 * m * psi, (what, ledger, psi)
        kept = runs["pp2 interleaved kept"]
        assert kept["ledger"]["all_gather"] == 4 * sum(kept["units"]), kept["ledger"]


def _check_accounting(runs, flavour, dp, m):
    """Bytes per rank and the dp ledger of the last step against their formulas (4-byte fp32 elements)."""
    base = runs["zero3"]
    shard, units, names = base["shard"], base["units"], base["names"]
    psi = sum(units)  # this rank's replica, padded: each unit rounded up to a multiple of dp
    assert psi == dp * shard and all(u % dp == 0 for u in units)
    # shard-sized fp32 parameters (= the master), fp32 gradient shard, exp_avg + exp_avg_sq: 16 bytes/element
    memory = base["memory"]
    assert (memory["param_bytes"], memory["grad_bytes"], memory["optimizer_state_bytes"]) == \
        (4 * shard, 4 * shard, 8 * shard), memory
    embedding, head, blocks = units[names.index("embedding")], units[names.index("head")], units[1:-1]
    if flavour == "gpt2":  # tied: the head borrows the embedding, in forward and in its backward
        assert memory["peak_gathered_bytes"] == 4 * (embedding + head + max(blocks)), (memory, units)
        borrowed = 2 * embedding
    else:  # prefetch 1: never more than the running unit and the next one
        assert memory["peak_gathered_bytes"] == 4 * max(a + b for a, b in zip(units, units[1:])), (memory, units)
        borrowed = 0
    reduce = {"all_reduce": 8, "reduce_scatter": 4 * m * psi}  # (all_reduce: the step's token count)
    assert base["ledger"] == {"all_gather": 4 * m * (2 * psi + borrowed), **reduce}, (base["ledger"], psi)
    # The planner (plan/zero3.py) says the same: shard + gathered peak, moments, ledger bytes (no padding here).
    plan = base["plan"]
    assert plan["param_bytes"] == memory["param_bytes"] + memory["peak_gathered_bytes"], (plan, memory)
    assert plan["optimizer"] == memory["optimizer_state_bytes"]
    assert (plan["comm"]["dp/all_gather"], plan["comm"]["dp/reduce_scatter"]) == \
        (base["ledger"]["all_gather"], base["ledger"]["reduce_scatter"]), (plan["comm"], base["ledger"])
    if "reshard off" in runs:
        assert runs["reshard off"]["ledger"] == {"all_gather": 4 * m * psi, **reduce}
    if "keep, prefetch 2" in runs:
        keep = runs["keep, prefetch 2"]
        assert keep["ledger"] == {"all_gather": 4 * psi, **reduce}
        assert keep["memory"]["peak_gathered_bytes"] == 4 * psi, keep["memory"]
