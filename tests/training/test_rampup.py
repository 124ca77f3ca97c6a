"""--rampup-batch-size START INCREMENT SAMPLES through the training loop's main.

The oracle of the rule is Megatron-LM's floating-point form, written out here; a ramped run logs
each step's batch, throughput of that batch and the learning rate at the samples consumed; a run
resumed mid-ramp takes exactly the uninterrupted run's batches and losses; (pp 2 interleaved,
dp 2) under a ramp gives the single process's losses; impossible ramps stop in one line, exit 2.
"""
import contextlib
import io
import json
import math

import pytest

from megalite.cli import parse_args, to_toml
from megalite.config.rampup import BatchRampup
from megalite.optim.lr_schedule import LRSchedule
from megalite.testing import run_distributed
from megalite.training.launch_checks import launch_problems
from megalite.training.loop import main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "16", "--eval-iters", "0",
         "--log-interval", "1", "--lr-warmup-iters", "2"]
RAMP = ["--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
        "--train-iters", "6"]


def _megatron_batch(consumed, start, increment, samples, full):
    """Megatron-LM's rule as it computes it: floor(consumed / (samples / increments)) in floating point."""
    if consumed > samples:
        return full
    return start + int(consumed / (samples / ((full - start) // increment))) * increment


def test_the_ramp_is_megatrons_rule():
    for start, increment, samples, full in [(2, 2, 12, 8), (16, 16, 5_859_375, 1536), (4, 4, 10, 16), (1, 3, 7, 10)]:
        ramp = BatchRampup(start, increment, samples, full)
        for consumed in list(range(0, 3 * samples, max(1, samples // 997))) + [samples, samples + 1]:
            assert ramp.batch_size_at(consumed) == _megatron_batch(consumed, start, increment, samples, full), consumed
        assert ramp.sizes() == list(range(start, full + 1, increment))
    assert BatchRampup(2, 2, 12, 8).batch_sizes(6) == [2, 2, 4, 6, 8, 8]  # consumed 0, 2, 4, 8, 14, 22
    ramp = BatchRampup(16, 16, 5_859_375, 1536)  # Megatron's GPT-3 175B ramp: the samples still to come (the ETA)
    for steps, consumed in [(0, 0), (1, 0), (5000, 0), (20_000, 123_456), (50, 5_859_000), (7, 6_000_000)]:
        assert ramp.samples_in(steps, consumed) == sum(ramp.batch_sizes(steps, consumed))


def test_the_eta_of_a_growing_batch_goes_by_samples():
    from megalite.config.model import GPTConfig
    from megalite.training.metrics import ThroughputMeter

    meter = ThroughputMeter(GPTConfig("gpt2", num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64,
                                      seq_length=8), 8, micro_batch_size=1, dp=1,
                            num_microbatches=8, world_size=1, total_steps=4)
    record = meter.step(1, 2.0, samples=2, remaining_samples=20)  # 1 s per sample, 20 samples in 3 steps to come
    assert (record["effective_batch"], record["tokens_per_step"], record["eta_s"]) == (2, 16, 20.0)
    assert meter.step(2, 2.0)["eta_s"] == 2 * 2.0  # without a ramp: the remaining steps at the step time


def test_the_sampler_takes_each_batch_where_the_last_ended():
    from megalite.data import GlobalBatchSampler

    ramp = BatchRampup(2, 2, 12, 8)
    sampler = GlobalBatchSampler(1000, 8, 1, dp_rank=1, dp_size=2, batch_size_at=ramp.batch_size_at)
    steps = [next(iter(sampler)) for _ in range(5)]
    starts = [0, 2, 4, 8, 14]  # consumed before each step: batches 2, 2, 4, 6, 8
    for step, start, batch in zip(steps, starts, [2, 2, 4, 6, 8]):  # dp rank 1: the second half, one per microbatch
        assert step == [[i] for i in range(start + batch // 2, start + batch)]
    assert sampler.consumed_samples == 22 and sampler.last_batch_size == 8
    resumed = GlobalBatchSampler(1000, 8, 1, dp_rank=1, dp_size=2, consumed_samples=8, batch_size_at=ramp.batch_size_at)
    assert next(iter(resumed)) == steps[3]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def test_a_ramped_run_logs_each_batch_and_resumes_mid_ramp_exactly(tmp_path, capsys):
    argv = MODEL + RAMP + ["--metrics-file", str(tmp_path / "a.jsonl"), "--save", str(tmp_path / "ckpt"),
                           "--save-interval", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batch ramp-up: global 2 -> 8 by 2 over 12 samples (1 -> 4 microbatches); the full batch from step 5; " \
           "30 samples in the run" in out
    assert "| batch 6 |" in out  # the progress line of step 4
    run = _records(tmp_path / "a.jsonl")
    assert [r["effective_batch"] for r in run] == [r["global_batch_size"] for r in run] == [2, 2, 4, 6, 8, 8]
    assert all(r["tokens_per_step"] == 16 * r["effective_batch"] for r in run)
    assert all(math.isclose(r["samples_per_sec"], r["effective_batch"] / r["step_time_s"]) for r in run)
    # the learning rate at the samples consumed before each step, in full batches of 8 (warm-up 2, decay 6)
    schedule = LRSchedule(2e-3, 2e-4, 2, 6, "cosine")
    assert [r["lr"] for r in run] == [schedule(c / 8) for c in (0, 2, 4, 8, 14, 22)]

    # resumed after step 3 (8 samples consumed, the next batch 6): the uninterrupted batches and losses
    resumed_argv = MODEL + RAMP + ["--metrics-file", str(tmp_path / "b.jsonl"), "--load", str(tmp_path / "ckpt"),
                                   "--load-step", "3"]
    assert main(resumed_argv) == 0
    resumed = _records(tmp_path / "b.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [(r["effective_batch"], r["loss"], r["lr"]) for r in resumed] == \
        [(r["effective_batch"], r["loss"], r["lr"]) for r in run[3:]]


def _main_capturing(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("ramp, needle", [
    (["3", "1", "10"], "the ramp's global batch 3 is not a multiple of micro_batch_size*dp = 2*1 = 2"),
    (["8", "2", "10"], "START 8 must be below --global-batch-size 8"),
    (["2", "4", "10"], "8 - START 2 = 6 is not a multiple of INCREMENT 4"),
    (["2", "0", "10"], "--rampup-batch-size must be an integer >= 1, got 2 0 10"),
])
def test_an_impossible_ramp_is_one_line(ramp, needle):
    code, err = _main_capturing(MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8",
                                         "--rampup-batch-size", *ramp])
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_every_microbatch_count_of_the_ramp_meets_the_schedule():
    """Interleaved 1F1B needs microbatches % pp == 0 at every step of the ramp, not only the last."""
    layout = ["--num-layers", "4", "--pp", "2", "--virtual-stages", "2", "--micro-batch-size", "1",
              "--global-batch-size", "8"]
    bad = parse_args(layout + ["--rampup-batch-size", "2", "3", "12"])[0].resolved(2, 257)  # batches 2, 5, 8
    problems = launch_problems(bad, 2, 257)
    assert len(problems) == 1 and "num_microbatches (5) to be a multiple of pp (2)" in problems[0]
    assert "a --rampup-batch-size step of 5 samples" in problems[0]
    good = parse_args(layout + ["--rampup-batch-size", "4", "2", "12"])[0].resolved(2, 257)
    assert launch_problems(good, 2, 257) == []

def test_the_ramp_round_trips_through_a_config_file(tmp_path):
    cfg = parse_args(RAMP)[0].resolved(1, 257)
    (tmp_path / "run.toml").write_text(to_toml(cfg))
    assert parse_args(["--config", str(tmp_path / "run.toml")])[0].training.rampup_batch_size == (2, 2, 12)


@pytest.mark.slow  # 4 forked ranks: 3 to 30 s on 2 shared cores, by the load
def test_pipeline_and_data_parallel_under_a_ramp_match_one_process(tmp_path):
    ramp = MODEL[:1] + ["4"] + MODEL[2:] + ["--micro-batch-size", "1", "--global-batch-size", "12",
                                            "--rampup-batch-size", "4", "4", "16", "--train-iters", "5"]
    assert main(ramp + ["--metrics-file", str(tmp_path / "one.jsonl")]) == 0
    layout = ["--pp", "2", "--virtual-stages", "2", "--zero", "1", "--metrics-file", str(tmp_path / "four.jsonl")]
    assert run_distributed(main, 4, ramp + layout, timeout_s=300) == [0] * 4
    one, four = _records(tmp_path / "one.jsonl"), _records(tmp_path / "four.jsonl")
    assert [r["effective_batch"] for r in four] == [4, 4, 8, 12, 12]  # 2, 2, 4, 6, 6 microbatches per dp rank
    for a, b in zip(one, four):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], a["step"]
