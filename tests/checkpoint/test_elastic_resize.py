"""Elastic resize end to end (megalite.training.loop on forked gloo ranks, fp32 on CPU).

One run is stopped by SIGTERM (it saves and exits 0) and resumed by the same command line on
another world: 4 ranks (tp 2 x dp 2) for steps 1-2, 2 ranks (tp 2 x dp 1) for steps 3-4, 4 ranks
again for steps 5-6, against the uninterrupted 4-rank run.

What is bit-identical under --elastic-batch keep, and why: each step reads the same samples in the
same microbatches (the data position is a global index), the learning rate is the same, and every
gradient element is a sum of two contributions either way (dp 2 x 1 microbatch: one addition in
the all-reduce; dp 1 x 2 microbatches: one addition in the accumulation; fp32 addition commutes),
so the gradients, their norm (ZeRO 0: taken over whole gradients on every layout), the updates,
the parameters and the optimizer state are bit-identical. So is the logged loss: a rank adds its
microbatches' float32 loss sums in float64 (exactly), so moving a microbatch from the all-reduce
into a rank's own sum changes no bit.
Hence a Llama-flavoured model: GPT-2 ties the output layer to the embedding, whose gradient then
sums four contributions per step (two uses in each of two microbatches), and more than two terms
are summed in another order on another dp; so do dp 4 -> dp 1 x 4 microbatches, and ZeRO's norm
over dp shards. There the last bits differ (the curve agrees to float32 noise, not bit for bit).
"""
import contextlib
import io
import json
import os
import shutil
import signal

import pytest
import torch

from megalite.checkpoint import storage
from megalite.checkpoint.boxes import box_slices
from megalite.checkpoint.reader import CheckpointReader
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training import loop  # imported once here: the forked ranks inherit it

ITERS = 6
ARGV = ["--model", "tiny-llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
        "--tp", "2", "--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "4", "--zero", "0",
        "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "2"]


def _run(argv, stop_after=None):
    """loop.main on this rank; a SIGTERM during step `stop_after` (every rank then saves after it and
    exits 0). Returns (exit code, this rank's output, {step: this dp rank's microbatches})."""
    seen = {}
    timed_step, inject = loop.timed_step, loop.maybe_inject_fault

    def recording_step(step, indices, **parts):
        if parts["mesh"].tp_rank == 0:  # tp ranks read the same samples
            seen[step] = (parts["mesh"].dp_rank, indices)
        return timed_step(step, indices, **parts)

    def stop_during(step, rank):
        if step == stop_after and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        inject(step, rank)

    loop.timed_step, loop.maybe_inject_fault = recording_step, stop_during
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = loop.main(argv)
    return code, out.getvalue() + err.getvalue(), seen


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _global_order(results):
    """{step: the step's sample indices in global order (dp rank 0's microbatches first)}."""
    by_step = {}
    for _, _, seen in results:
        for step, (dp_rank, microbatches) in seen.items():
            by_step.setdefault(step, {})[dp_rank] = [i for mb in microbatches for i in mb]
    return {step: [i for r in sorted(ranks) for i in ranks[r]] for step, ranks in by_step.items()}


def _state(checkpoint):
    """{(kind, name): full tensor} of everything a checkpoint stores but RNG states."""
    reader = CheckpointReader(checkpoint)
    out = {}
    for (kind, name), rows in reader.items.items():
        if kind == "rng":
            continue
        shape = [max(box[d][1] for box, *_ in rows) for d in range(len(rows[0][0]))]
        full = torch.empty(shape, dtype=rows[0][1])
        box = tuple((0, n) for n in shape)
        reader.verify_box(kind, name, box)
        reader.read_into(kind, name, box, full[box_slices(box)])
        out[(kind, name)] = full
    reader.close()
    return out


def _launch(world, argv, stop_after=None):
    results = run_distributed(_run, world, argv, stop_after, timeout_s=180)
    assert [code for code, _, _ in results] == [0] * world, results[0][1][-3000:]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    ref = ARGV + ["--save", str(root / "ref"), "--metrics-file", str(root / "ref.jsonl")]
    reference = _launch(4, ref)
    keep = ARGV + ["--save", str(root / "keep"), "--load", str(root / "keep"), "--metrics-file",
                   str(root / "keep.jsonl")]
    chain = [_launch(4, keep, stop_after=2)]
    shutil.copytree(root / "keep", root / "scale")  # the 4-rank checkpoint of step 2, resumed with scale too
    chain += [_launch(2, keep, stop_after=4), _launch(4, keep)]
    scale = ARGV + ["--save", str(root / "scale"), "--load", str(root / "scale"), "--metrics-file",
                    str(root / "scale.jsonl"), "--elastic-batch", "scale"]
    scaled = _launch(2, scale)
    return root, reference, chain, scaled


def test_keep_continues_the_uninterrupted_curve_across_4_2_4_ranks(runs):
    root, reference, chain, _ = runs
    ref = {r["step"]: r for r in _records(root / "ref.jsonl") if "loss" in r}
    records = _records(root / "keep.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, ITERS + 1))  # each step once: SIGTERM saved after it
    for r in steps:  # steps 3 and 4 ran on 2 ranks
        assert r["grad_norm"] == ref[r["step"]]["grad_norm"] and r["lr"] == ref[r["step"]]["lr"], r["step"]
        assert r["effective_batch"] == 4
        assert r["loss"] == ref[r["step"]]["loss"], r["step"]
    # Parameters and optimizer state after step 6: bit for bit.
    mine, theirs = _state(root / "keep" / "step_000006"), _state(root / "ref" / "step_000006")
    assert mine.keys() == theirs.keys() and any(kind == "exp_avg" for kind, _ in mine)
    assert [key for key in mine if not torch.equal(mine[key], theirs[key])] == []
    # Every world-size change is in the metrics, where it happened.
    events = [{k: r[k] for k in ("step", "old_world_size", "new_world_size", "old_dp", "new_dp",
                                 "old_global_batch_size", "new_global_batch_size", "old_num_microbatches",
                                 "new_num_microbatches", "batch_rule", "lr_factor")}
              for r in records if r.get("event") == "resize"]
    assert events == [
        {"step": 2, "old_world_size": 4, "new_world_size": 2, "old_dp": 2, "new_dp": 1, "old_global_batch_size": 4,
         "new_global_batch_size": 4, "old_num_microbatches": 1, "new_num_microbatches": 2, "batch_rule": "keep",
         "lr_factor": 1.0},
        {"step": 4, "old_world_size": 2, "new_world_size": 4, "old_dp": 1, "new_dp": 2, "old_global_batch_size": 4,
         "new_global_batch_size": 4, "old_num_microbatches": 2, "new_num_microbatches": 1, "batch_rule": "keep",
         "lr_factor": 1.0}]
    assert [r["step"] for r in records].index(2) < [r.get("event") for r in records].index("resize")
    log = chain[1][0][1]
    assert "ELASTIC RESIZE after step 2: world 4 -> 2 ranks (tp 2, pp 1; dp 2 -> 1)" in log, log[-3000:]
    assert "global batch 4 kept (accumulation 1 -> 2)" in log and "--dp 2 is the checkpoint's" in log


def test_keep_reads_exactly_the_reference_samples(runs):
    _, reference, chain, _ = runs
    expected = _global_order(reference)
    seen = {}
    for launch in chain:
        for step, order in _global_order(launch).items():
            assert step not in seen, f"step {step} ran twice"
            seen[step] = order
    assert seen == expected  # same samples, same order, each step
    everything = [i for step in sorted(seen) for i in seen[step]]
    assert sorted(everything) == list(range(ITERS * 4))  # none repeated, none skipped (first epoch)


def test_scale_halves_the_batch_and_the_learning_rate_and_keeps_the_data_position(runs):
    root, reference, chain, scaled = runs
    ref = {r["step"]: r for r in _records(root / "ref.jsonl") if "loss" in r}
    records = _records(root / "scale.jsonl")
    event, = [r for r in records if r.get("event") == "resize"]
    assert (event["step"], event["old_world_size"], event["new_world_size"], event["old_dp"], event["new_dp"]) == \
        (2, 4, 2, 2, 1)
    assert (event["old_global_batch_size"], event["new_global_batch_size"], event["batch_rule"],
            event["lr_rule"], event["lr_factor"], event["lr_factor_total"]) == (4, 2, "scale", "linear", 0.5, 0.5)
    after = [r for r in records if "loss" in r and r["step"] > 2]
    assert [r["step"] for r in after] == [3, 4, 5, 6]
    assert all(r["lr"] == 0.5 * ref[r["step"]]["lr"] and r["effective_batch"] == 2 for r in after)
    assert "learning rate x0.5 by the linear rule: peak 2.000e-03 -> 1.000e-03" in scaled[0][1]
    # Positions continue from the checkpoint's consumed samples (8) at 2 per step.
    before, later = _global_order(chain[0]), _global_order(scaled)
    assert {s: later[s] for s in (3, 4, 5, 6)} == {3: [8, 9], 4: [10, 11], 5: [12, 13], 6: [14, 15]}
    assert sorted(i for order in (before, later) for s in order for i in order[s]) == list(range(16))
    # The next start of this run keeps the scaled batch and LR: both are in the checkpoint.
    saved = json.loads((root / "scale" / "step_000006" / storage.METADATA).read_text())
    assert saved["train_config"]["training"]["global_batch_size"] == 2
    assert saved["train_config"]["optimizer"]["lr"] == 1e-3 and saved["extra"]["elastic"]["lr_factor"] == 0.5


def test_a_world_that_cannot_hold_the_layout_is_refused_on_every_rank(runs):
    root = runs[0]
    argv = ARGV + ["--save", str(root / "keep"), "--load", str(root / "keep")]
    results = run_distributed(_run, 3, argv, timeout_s=60)
    assert [code for code, _, _ in results] == [2, 2, 2]
    assert all("Traceback" not in out for _, out, _ in results)
    assert "on 3 ranks: 3 is not a multiple of the 2 ranks of one model replica (tp 2 x pp 1); launch 2, 4, 6, 8" \
        in results[0][1], results[0][1]


# A mixture-of-experts run (issue 27) resumed from step 1 of an uninterrupted 4-rank run (tp 2, dp 2, ep 2;
# ZeRO 1; it saves every step) on 2 ranks (tp 2, dp 1) by the same command line: --ep 2 is the checkpoint's
# and no longer divides dp 1, so the plan fits ep 1 (every rank now holds all 4 experts, loaded whole with
# their Adam state and the routers' expert biases, which a large bias step makes matter to the routing).
# (The SIGTERM save is the dense runs' above.) Not bit for bit: an expert's gradient at ep 2 is one grouped
# GEMM over both dp ranks' routes, at ep 1 two accumulated microbatches: another summation order. Loss, norm,
# MoE losses and every stored tensor agree to float32 noise (1e-5 relative).
MOE_ITERS = 3
MOE_ARGV = ["--model", "moe-tiny", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "32", "--seq-length", "16",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
            "0.001", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
            "--tp", "2", "--dp", "2", "--ep", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--zero", "1",
            "--train-iters", str(MOE_ITERS), "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "2"]


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_moe_run_resized_from_ep2_to_ep1_continues_the_uninterrupted_curve(tmp_path):
    ref = tmp_path / "ref"
    _launch(4, MOE_ARGV + ["--save", str(ref), "--save-interval", "1", "--metrics-file", str(tmp_path / "ref.jsonl")])
    resumed = _launch(2, MOE_ARGV + ["--load", str(ref), "--load-step", "1", "--save", str(tmp_path / "resized"),
                                     "--metrics-file", str(tmp_path / "resized.jsonl")])
    log = resumed[0][1]
    assert "world 4 -> 2 ranks (tp 2, pp 1; dp 2 -> 1, ep 2 -> 1)" in log, log[-3000:]
    assert "--ep 2 (the checkpoint's) does not divide dp*cp = 1*1 on the new world; ep 1 instead" in log
    expected = {r["step"]: r for r in _records(tmp_path / "ref.jsonl") if "loss" in r}
    records = _records(tmp_path / "resized.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(2, MOE_ITERS + 1))
    for r in steps:
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            assert r[key] == pytest.approx(expected[r["step"]][key], rel=1e-5, abs=0), (r["step"], key)
        assert r["lr"] == expected[r["step"]]["lr"] and r["effective_batch"] == 8
    event, = [r for r in records if r.get("event") == "resize"]
    assert (event["old_dp"], event["new_dp"], event["old_ep"], event["new_ep"]) == (2, 1, 2, 1)
    resumed_from = _state(ref / "step_000001")
    assert all(resumed_from[key].any() for key in resumed_from if key[0] == "expert_bias")  # the biases had moved
    mine, theirs = _state(tmp_path / "resized" / f"step_{MOE_ITERS:06d}"), _state(ref / f"step_{MOE_ITERS:06d}")
    assert mine.keys() == theirs.keys()
    kinds = {kind for kind, _ in mine}
    assert {"exp_avg", "expert_bias"} <= kinds and any(".experts.3." in name for _, name in mine), kinds
    for key in mine:
        assert_tensor_close(mine[key], theirs[key], rtol=1e-5, what=str(key))
