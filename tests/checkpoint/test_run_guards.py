"""What keeps a run's checkpoints and answers its own (issue 40), on one in-process rank:
the --save lock, SIGINT and a signal during set-up, and a resume's settings against its checkpoint's."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megalite.training import loop

from ckpt_helpers import SMALL_RUN, run_in_process

LOCK_NAME = "megalite.lock"  # megalite.checkpoint.lock's

SMALL, _main = SMALL_RUN, run_in_process


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_lock(directory, **holder):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "job": "", **holder}))


def test_a_second_run_on_a_locked_save_directory_refuses_in_one_line(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the other run, alive
    try:
        _write_lock(tmp_path, pid=sleeper.pid)
        code, _, err = _main(SMALL + ["--train-iters", "1", "--save", str(tmp_path)])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"is in use by another run (host {socket.gethostname()}, pid {sleeper.pid})" in err, err
    assert not list(tmp_path.glob("step_*"))  # nothing of this run written


def test_a_stale_lock_is_replaced_and_the_run_releases_its_own(tmp_path):
    _write_lock(tmp_path, pid=_dead_pid())
    code, out, _ = _main(SMALL + ["--train-iters", "1", "--save", str(tmp_path)])
    assert code == 0 and "replacing the stale lock" in out and "no longer exists" in out, out
    assert (tmp_path / "step_000001").is_dir() and not (tmp_path / LOCK_NAME).exists()


def test_stale_rules_for_another_host_and_the_same_job(tmp_path, monkeypatch):
    from megalite.checkpoint.lock import STALE_S, CheckpointLock, stale_reason

    now = time.time()
    other = {"host": "another-host", "pid": 1, "job": "slurm 7"}
    assert stale_reason(other, mtime=now - 10, now=now) is None  # refreshed recently: that run is alive
    assert "not refreshed" in stale_reason(other, mtime=now - STALE_S - 1, now=now)
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # this job, restarted on another node
    assert "this job's" in stale_reason(other, mtime=now, now=now)
    lock = CheckpointLock(tmp_path).acquire()
    with pytest.raises(Exception, match="in use by another run"):
        monkeypatch.setenv("SLURM_JOB_ID", "8")
        CheckpointLock(tmp_path).acquire()  # same host, live pid (this process), another job
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_ctrl_c_saves_at_the_step_boundary_and_exits_cleanly(tmp_path, monkeypatch):
    def ctrl_c_at_step_2(step, rank):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop, "maybe_inject_fault", ctrl_c_at_step_2)
    code, out, err = _main(SMALL + ["--train-iters", "4", "--save", str(tmp_path)])
    assert code == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002"]
    stops = [line for line in (out + err).splitlines() if "SIGINT" in line]
    assert stops == [f"megalite: SIGINT: stopped after step 2, saved; resume with --load {tmp_path}"], out + err


def test_a_signal_during_set_up_ends_the_run_at_once(tmp_path, monkeypatch):
    def slow_resume(job):  # loading a large checkpoint; the scheduler's SIGTERM arrives meanwhile
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        return 0

    monkeypatch.setattr(loop, "resume", slow_resume)
    start = time.perf_counter()
    code, _, err = _main(SMALL + ["--train-iters", "3", "--save", str(tmp_path)])
    assert code == 128 + signal.SIGTERM and time.perf_counter() - start < 30
    assert err.strip() == "megalite: SIGTERM during set-up (before the first step): stopped, nothing trained or saved"
    assert not list(tmp_path.glob("step_*")) and not (tmp_path / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_resuming_with_another_schedule_or_seed_is_named_and_refused_unless_overridden(tmp_path):
    run = SMALL + ["--save", str(tmp_path), "--load", str(tmp_path)]
    assert _main(run + ["--train-iters", "2"])[0] == 0
    code, _, err = _main(run + ["--train-iters", "4", "--lr", "1e-3", "--seed", "5"])
    assert code == 2 and "Traceback" not in err, err
    assert "--lr 0.002 -> 0.001, --train-iters 2 -> 4 changes the learning-rate schedule; resume with " \
           "--lr 0.002 --train-iters 2 as its run had, or pass --override-opt-param-scheduler" in err, err
    assert "--seed 1234 -> 5 changes the order of the samples read" in err and "--override-data-order" in err
    code, out, err = _main(run + ["--train-iters", "4", "--seed", "5", "--override-opt-param-scheduler",
                                  "--override-data-order", "--weight-decay", "0.2"])
    assert code == 0, err
    assert "megalite: resuming checkpoint step 2 with settings that differ from its run: --train-iters 2 -> 4, " \
           "--seed 1234 -> 5, --weight-decay 0.1 -> 0.2" in out, out
    code, out, err = _main(run + ["--train-iters", "4", "--seed", "5", "--weight-decay", "0.2"])  # as step 4's run
    assert code == 0 and "differ from its run" not in out, err
