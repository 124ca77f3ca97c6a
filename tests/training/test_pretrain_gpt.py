"""examples/pretrain_gpt.py end to end on forked gloo ranks: bad input and a short real run."""
import importlib.util
import json
import pathlib

import pytest

from megalite.testing import run_distributed

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"


def _main(argv):
    spec = importlib.util.spec_from_file_location("pretrain_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


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
])
def test_bad_configuration_fails_fast_on_every_rank(world, argv, needle):
    results = run_distributed(_main_capturing, world, argv, timeout_s=60)
    for code, err in results:  # every rank: exit code 2, the fix named, no traceback
        assert code == 2
        assert needle in err, err
        assert "Traceback" not in err


def test_short_run_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--tp", "2", "--pp", "2", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", "3", "--metrics-file", str(metrics), "--profile-steps", "2", "3",
            "--profile-dir", str(tmp_path / "profile")]
    assert run_distributed(_main, 4, argv, timeout_s=120) == [0, 0, 0, 0]
    traces = sorted((tmp_path / "profile").glob("*.json"))  # one Chrome trace per rank, phases named
    assert [t.name for t in traces] == [f"trace_rank{r:05d}_steps2-3.json" for r in range(4)]
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
    for code, err in results:  # every rank, before any collective: the path and what to do
        assert code == 2 and "cannot create it" in err and str(blocker / "ckpt") in err, err
        assert "Traceback" not in err


def test_save_directory_without_room_for_one_checkpoint_fails_early(tmp_path, monkeypatch):
    import argparse
    import shutil

    from megalite.training.arguments import ConfigError, build_parser, resolve

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10 ** 6))  # 1 MB free
    args: argparse.Namespace = build_parser().parse_args(["--save", str(tmp_path / "ckpt")])
    with pytest.raises(ConfigError, match=r"--save .*ckpt: 0\.00 GB free, but this node's ranks write 0\.0\d GB"):
        resolve(args, 1, 256)
    assert list((tmp_path / "ckpt").iterdir()) == []  # the write probe left nothing behind
    monkeypatch.setattr(shutil, "disk_usage", real)
    resolve(args, 1, 256)  # with the real free space the same flags pass
