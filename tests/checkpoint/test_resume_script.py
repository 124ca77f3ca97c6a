"""examples/pretrain_gpt.py with --save/--load: a SIGTERM stops every rank after the same step
with a checkpoint and exit code 0; the same command line then resumes, and a rank killed under
`torchrun --max-restarts 1` is restarted from the latest checkpoint by torchrun itself. Either
way the loss of every step equals the uninterrupted run's exactly (float32 on CPU, dropout on:
data position, LR step, optimizer state and RNG states all restored).
"""
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from megalite.testing import run_distributed

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
ITERS = 8
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--log-interval", "1",
        "--eval-iters", "0", "--lr-warmup-iters", "2", "--hidden-dropout", "0.1", "--zero", "1"]


def _main(argv, signal_at_step=None, signal_rank=None):
    """Run the training loop's main(); optionally deliver a real SIGTERM to one rank during a step."""
    from megalite.training import loop

    if signal_at_step is not None:
        inject = loop.maybe_inject_fault

        def signal_during(step, rank):  # the loop calls this at the start of every step
            if step == signal_at_step and rank == signal_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            inject(step, rank)

        loop.maybe_inject_fault = signal_during
    return loop.main(argv)


def _losses(path):
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("reference") / "metrics.jsonl"
    assert run_distributed(_main, 2, ARGV + ["--metrics-file", str(metrics)], timeout_s=120) == [0, 0]
    losses = _losses(metrics)
    assert [s for s, _ in losses] == list(range(1, ITERS + 1))
    return losses


def test_sigterm_saves_and_the_same_command_resumes(reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = ARGV + ["--save", str(ckpt), "--load", str(ckpt), "--metrics-file", str(metrics), "--async-save",
                   "--save-interval", "2", "--keep-last", "1"]
    # First start: no checkpoint yet. Rank 1 alone gets SIGTERM during step 3: both stop after step 3.
    assert run_distributed(_main, 2, argv, signal_at_step=3, signal_rank=1, timeout_s=120) == [0, 0]
    assert json.loads((ckpt / "latest").read_text())["step_dir"] == "step_000003"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000003"]  # --keep-last 1 pruned step 2
    assert [s for s, _ in _losses(metrics)] == [1, 2, 3]
    # The same command line resumes from step 3 and finishes.
    assert run_distributed(_main, 2, argv, timeout_s=120) == [0, 0]
    assert _losses(metrics) == reference


def test_torchrun_restarts_a_killed_rank_from_the_latest_checkpoint(reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", str(SCRIPT)] + ARGV + [
        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--metrics-file", str(metrics)]
    # torchrun shares its rendezvous store with the workers by default; gloo then sometimes reads the
    # dead attempt's addresses on restart (pytorch/pytorch#135712): give each attempt its own store.
    env = dict(os.environ, MEGALITE_FAULT_AT_STEP="5", MEGALITE_FAULT_RANK="1", OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-15000:]
    assert "rank 1 exits at step 5" in log, log[-4000:]  # the fault happened (first attempt only)
    assert "loaded" in log and "step 4" in log, log[-4000:]  # the restart resumed from step 4
    # Attempt 0 logged steps 1-4, the restarted attempt 5-8: together the uninterrupted run.
    assert _losses(metrics) == reference


@pytest.mark.parametrize("argv,needle", [
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--load-step", "3"], "--load-step needs --load DIR"),
    (["--save", "x", "--keep-last", "-1"], "--keep-last must be >= 0"),
])
def test_bad_checkpoint_flags_name_the_fix(argv, needle, capsys):
    assert _main(argv) == 2
    assert needle in capsys.readouterr().err
