"""The training loop (megalite.training.loop, what examples/pretrain_gpt.py runs) end to end on
forked gloo ranks: bad input, a short real run, and resources released when a step raises."""
import json
import signal
import threading

import pytest

from megalite.testing import run_distributed
from megalite.training.loop import main as _main


def _main_capturing(argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("world,argv,needle", [
    (4, ["--tp", "3"], "world size 4 != tp*pp*dp"),
    (4, ["--tp", "4", "--num-attention-heads", "6", "--hidden-size", "96"], "num_attention_heads=6 is not divisible by tp=4"),
    (2, ["--dp", "2", "--micro-batch-size", "3", "--global-batch-size", "8"], "global_batch_size=8 is not divisible"),
    (2, ["--data-path", "/nonexistent/corpus"], "data files not found: /nonexistent/corpus.bin"),
    (4, ["--pp", "4", "--num-layers", "2"], "num_layers=2 cannot fill pp*v = 4*1 = 4 pipeline chunks"),
    (2, ["--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "8"], "1 microbatches < pp=2"),
    (2, ["--train-iters", "5", "--profile-steps", "4", "9"], "--profile-steps 4 9 must satisfy 1 <= FIRST <= LAST"),
    (2, ["--grad-compression", "powersgd", "--grad-reduce-dtype", "bf16"], "drop --grad-reduce-dtype bf16"),
])
def test_bad_configuration_fails_fast_on_every_rank(world, argv, needle):
    results = run_distributed(_main_capturing, world, argv, timeout_s=60)
    for code, err in results:  # every rank: exit code 2, no traceback
        assert code == 2
        assert "Traceback" not in err
    assert needle in results[0][1], results[0][1]  # the fix named once per node (local rank 0)
    assert all(err == "" for _, err in results[1:])


def test_short_run_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--tp", "2", "--pp", "2", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", "3", "--metrics-file", str(metrics), "--profile-steps", "2", "3",
            "--profile-dir", str(tmp_path / "profile")]
    assert run_distributed(_main, 4, argv, timeout_s=120) == [0, 0, 0, 0]
    traces = sorted((tmp_path / "profile").glob("trace_*.json"))  # one Chrome trace per rank, phases named
    assert [t.name for t in traces] == [f"trace_rank{r:05d}_steps2-3.json" for r in range(4)]
    summaries = sorted((tmp_path / "profile").glob("ops_*.json"))  # and its ops by shape (tools/gemm_in_step.py)
    assert [s.name for s in summaries] == [f"ops_rank{r:05d}_steps2-3.json" for r in range(4)]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"megalite/data", "megalite/optimizer"} <= names, sorted(n for n in names if "megalite" in str(n))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["step"] for r in evals] == [3] and evals[0]["eval_perplexity"] > 1  # once, not again at the end
    for r in records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "param_bytes", "grad_bytes",
                    "optimizer_state_bytes"):
            assert key in r, key
        assert r["effective_batch"] == 8 and r["tokens_per_step"] == 8 * 32
        assert abs(r["tokens_per_sec"] - r["tokens_per_step"] / r["step_time_s"]) < 1e-6 * r["tokens_per_sec"]
        # The time split: pp=2 runs forward and backward interleaved as one "pipeline" phase.
        phases = r["time_data_s"] + r["time_pipeline_s"] + r["time_optimizer_s"]
        assert r["time_pipeline_s"] > 0 and phases <= r["step_time_s"]
        assert r["time_other_s"] == pytest.approx(r["step_time_s"] - phases, abs=1e-9)
        assert "time_communication_s" in r and 0 <= r["exposed_dp_comm_s"] <= r["time_optimizer_s"]


def test_compressed_run_reports_its_ratio(tmp_path):
    from megalite.cli import parse_args
    from megalite.plan.communication import communication_bytes

    metrics = tmp_path / "metrics.jsonl"
    argv = ["--dp", "2", "--num-layers", "1", "--hidden-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--metrics-file", str(metrics),
            "--grad-compression", "powersgd", "--powersgd-warmup-steps", "1", "--zero", "1"]
    assert run_distributed(_main, 2, argv, timeout_s=120) == [0, 0]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    cfg = parse_args(argv)[0].resolved(2, 257)
    sent = communication_bytes(cfg.gpt_config(), cfg, 0)["dp/all_reduce"]
    assert [r["grad_compression_ratio"] for r in records[:1]] == [1.0]  # the warm-up step is plain
    assert [r["grad_reduce_bytes"] for r in records[1:]] == [sent, sent]
    assert all(r["grad_compression_ratio"] == records[0]["grad_reduce_bytes"] / sent for r in records[1:])


def test_dry_run_prints_the_plan(capsys):
    assert _main(["--dry-run", "--model", "gpt2-124m", "--tp", "2", "--dp", "4", "--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "optimizer state" in out


def test_nonfinite_stop_exits_on_every_rank():
    argv = ["--dp", "2", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "4", "--lr", "1e30", "--lr-warmup-iters", "0", "--clip-grad", "0",
            "--on-nonfinite", "stop", "--hang-timeout", "60", "--check-replicas-interval", "1", "--eval-iters", "0"]
    results = run_distributed(_main_capturing, 2, argv, timeout_s=120)
    for code, err in results:
        assert code == 3, err  # NONFINITE_EXIT_CODE, the same on both ranks
        assert "non-finite" in err.lower() or "nan" in err.lower(), err


def test_unusable_save_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    results = run_distributed(_main_capturing, 2, ["--save", str(blocker / "ckpt")], timeout_s=60)
    for code, err in results:  # every rank, before any collective: exit 2, no traceback
        assert code == 2 and "Traceback" not in err, err
    err = results[0][1]  # the path and what to do, once per node
    assert "cannot create it" in err and str(blocker / "ckpt") in err, err


def test_save_directory_without_room_for_one_checkpoint_fails_early(tmp_path, monkeypatch):
    import shutil

    from megalite.cli import parse_args
    from megalite.errors import ConfigError
    from megalite.training.loop import configure

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10 ** 6))  # 1 MB free
    cfg, _ = parse_args(["--save", str(tmp_path / "ckpt")])
    with pytest.raises(ConfigError, match=r"--save .*ckpt: 1\.00 MB \(1000000 bytes\) free, but this node's ranks "
                                          r"write \d+\.\d\d MB \(\d+ bytes\)"):
        configure(cfg, 1, 256)
    assert list((tmp_path / "ckpt").iterdir()) == []  # the write probe left nothing behind
    monkeypatch.setattr(shutil, "disk_usage", real)
    configure(cfg, 1, 256)  # with the real free space the same flags pass


def _failing_run(tmp_path, exception):
    """Run the loop with every service on; step 3 raises `exception`. Returns what is left behind."""
    from megalite.distributed import comm
    from megalite.training import loop, step_run

    real_step, calls = step_run.train_step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise exception
        return real_step(*args, **kwargs)

    step_run.train_step = failing_step  # what loop's timed_step calls
    sigterm_before = signal.getsignal(signal.SIGTERM)
    argv = ["--dp", "2", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16", "--micro-batch-size", "2",
            "--train-iters", "5", "--log-interval", "1", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "1", "--async-save", "--hang-timeout", "60", "--metrics-file",
            str(tmp_path / "metrics.jsonl"), "--profile-steps", "3", "4", "--profile-dir", str(tmp_path / "prof")]
    try:
        loop.main(argv)
        raised = None
    except BaseException as exc:  # noqa: BLE001 - the test inspects what escaped
        raised = type(exc).__name__
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("megalite") and t.is_alive())
    return dict(raised=raised, process_group=comm.is_initialized(), threads=threads,
                sigterm_restored=signal.getsignal(signal.SIGTERM) == sigterm_before)


@pytest.mark.parametrize("exception", [RuntimeError("a step failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_loop_releases_its_resources_when_a_step_raises(tmp_path, exception):
    for rank, left in enumerate(run_distributed(_failing_run, 2, tmp_path, exception, timeout_s=120)):
        assert left["raised"] == type(exception).__name__, left  # the error propagates, unchanged
        assert not left["process_group"], f"rank {rank}: the process group was not destroyed"
        assert left["threads"] == [], f"rank {rank}: threads still running: {left['threads']}"
        assert left["sigterm_restored"], f"rank {rank}: the SIGTERM handler was not restored"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]  # flushed and closed
    assert (tmp_path / "metrics.config.toml").read_text().startswith("# megalite run configuration")
