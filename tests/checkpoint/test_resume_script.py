"""examples/pretrain_gpt.py with --save/--load: a SIGTERM stops every rank after the same step
with a checkpoint and exit code 0; the same command line then resumes, and workers SIGKILLed
under `torchrun --max-restarts N` (plain command, no environment variable, with and without
--master-port) are restarted from the latest checkpoint by torchrun itself. Either way the loss
of every step equals the uninterrupted run's exactly (float32 on CPU, dropout on: data
position, LR step, optimizer state and RNG states all restored).
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from megalite.testing import free_port, run_distributed

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
    assert sorted(p.name for p in ckpt.iterdir()) == ["goodput.json", "latest", "step_000003"]  # --keep-last 1
    # pruned step 2; goodput.json is the job's goodput ledger (megalite/training/goodput.py)
    assert [s for s, _ in _losses(metrics)] == [1, 2, 3]
    # The same command line resumes from step 3 and finishes.
    assert run_distributed(_main, 2, argv, timeout_s=120) == [0, 0]
    assert _losses(metrics) == reference


# Restarts under real torchrun, with no environment variable: (layout, launch, fault step, rank).
# A worker gets a real SIGKILL at the start of a step, under the default c10d rendezvous
# (--standalone: the agent shares its store) and under --master-port (the static rendezvous,
# whose store the agent holds for its whole life). Repeated restarts within one launch:
# tests/tools/test_fault_drill.py.
TORCHRUN_ITERS = 6
RESTART_CASES = {
    "tp2-dp2-standalone": (["--tp", "2", "--dp", "2"], ["--standalone"], "5", "3"),
    "pp2-dp2-master-port": (["--pp", "2", "--dp", "2"], ["--master-port", "PORT"], "3", "2"),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted losses of each 4-rank layout (forked ranks: no torchrun needed)."""
    out = {}
    for name, (layout, *_) in RESTART_CASES.items():
        metrics = tmp_path_factory.mktemp(name) / "metrics.jsonl"
        argv = ARGV + layout + ["--train-iters", str(TORCHRUN_ITERS), "--metrics-file", str(metrics)]
        assert run_distributed(_main, 4, argv, timeout_s=120) == [0] * 4
        out[name] = dict(_losses(metrics))
        assert sorted(out[name]) == list(range(1, TORCHRUN_ITERS + 1))
    return out


@pytest.mark.parametrize("case", sorted(RESTART_CASES))
@pytest.mark.slow
def test_torchrun_restarts_killed_workers_without_any_environment_variable(case, references, tmp_path):
    layout, launch, fault_step, fault_rank = RESTART_CASES[case]
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    launch = [str(free_port()) if arg == "PORT" else arg for arg in launch]
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc_per_node", "4", "--max-restarts", "1",
               "--monitor-interval", "0.1", str(SCRIPT)] + ARGV + layout + [
        "--train-iters", str(TORCHRUN_ITERS), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
        "--metrics-file", str(metrics)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_", "TORCHELASTIC_"))}
    env.update(MEGALITE_FAULT_AT_STEP=fault_step, MEGALITE_FAULT_RANK=fault_rank, MEGALITE_FAULT_SIGNAL="SIGKILL",
               OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-15000:]
    assert f"rank {fault_rank} gets SIGKILL at step {fault_step}" in log, log[-4000:]
    resumed = [int(n) for n in re.findall(r"loaded \S+ \(step (\d+),", log)]
    assert resumed == [(int(fault_step) - 1) // 2 * 2], log[-4000:]  # from the last save before the fault
    # Every logged step, including the ones a killed attempt logged and the next one redid,
    # equals the uninterrupted run exactly.
    logged = _losses(metrics)
    assert sorted({s for s, _ in logged}) == list(range(1, TORCHRUN_ITERS + 1))
    assert [(s, loss) for s, loss in logged if loss != references[case][s]] == []


@pytest.mark.parametrize("argv,needle", [
    (["--save-interval", "5"], "--save-interval needs --save DIR"),
    (["--load-step", "3"], "--load-step needs --load DIR"),
    (["--save", "x", "--keep-last", "-1"], "--keep-last must be an integer >= 0, got -1"),
])
def test_bad_checkpoint_flags_name_the_fix(argv, needle, capsys):
    assert _main(argv) == 2
    assert needle in capsys.readouterr().err
