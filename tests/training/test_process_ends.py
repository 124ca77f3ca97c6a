"""How a run's processes end (issue 49): a usage error on any local rank reaches the terminal once
(and torchrun's report names it), a stop signal ends set-up even while the main thread is blocked in
C, and a worker whose launcher died stops itself."""
import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megalite.checkpoint.preemption import _watch_parent
from megalite.errors import UsageError, report_usage_error
from megalite.testing import run_distributed


def _report(failing):
    """Each rank: what it printed (a rank not in `failing` has nothing to report)."""
    rank = int(os.environ["RANK"])
    if rank not in failing:
        return ""
    stream = io.StringIO()
    assert report_usage_error(UsageError(f"--tokenizer t.json: unreadable on rank {min(failing)}"), rank,
                              stream) == 2
    return stream.getvalue()


@pytest.mark.parametrize("failing", [(1,), (0, 1)])
def test_a_usage_error_on_any_local_rank_is_printed_once(failing):
    printed = run_distributed(_report, 2, failing, timeout_s=60)
    lines = "".join(printed).splitlines()
    assert lines == [f"megalite: --tokenizer t.json: unreadable on rank {failing[0]}"], printed


def test_the_error_file_holds_the_line_torchrun_reports(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with contextlib.redirect_stderr(io.StringIO()):
        report_usage_error(UsageError("--split inf,1,1: weights must be finite"), 0)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("megalite-train", {0: failure}).format_msg()
    assert "megalite: --split inf,1,1: weights must be finite" in report and "To enable traceback" not in report


BLOCKED_IN_C = textwrap.dedent("""
    import sys
    from torch.distributed import TCPStore
    from megalite.testing import free_port
    from megalite.checkpoint.preemption import SetupInterrupted, interrupt_during_setup
    store = TCPStore("127.0.0.1", free_port(), 1, True)
    try:
        with interrupt_during_setup():
            print("blocked", flush=True)
            store.wait(["a key no rank sets"])  # C++ waits here; Python's handler cannot run
    except SetupInterrupted as exc:
        print(f"megalite: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
""")


@pytest.mark.slow  # a subprocess importing torch (~3-12 s on a loaded machine)
def test_sigterm_ends_set_up_while_the_main_thread_waits_in_c():
    child = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "RANK": "0"})
    assert child.stdout.readline().strip() == "blocked"
    time.sleep(0.2)
    start = time.perf_counter()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert time.perf_counter() - start < 10 and child.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "megalite: SIGTERM during set-up (before the first step): stopped, nothing trained or saved"


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, "LOCAL_RANK": "0"})
    print(worker.pid, flush=True)
    worker.wait()
""")
WORKER = textwrap.dedent("""
    import pathlib, signal, sys, time
    from megalite.checkpoint.preemption import end_with_the_launcher
    stopped = pathlib.Path(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: stopped.write_text("SIGTERM"))  # the trainer: save at the step's end
    with end_with_the_launcher(poll_s=0.05):
        stopped.with_suffix(".ready").write_text("")
        while not stopped.exists():
            time.sleep(0.05)
""")


@pytest.mark.slow  # two subprocesses, one importing torch
def test_a_worker_whose_launcher_was_killed_stops_itself(tmp_path):
    stopped = tmp_path / "stopped"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WORKER, str(stopped)], stdout=subprocess.PIPE,
                                text=True)
    worker = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while not stopped.with_suffix(".ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.kill()  # torchrun's agent, SIGKILLed: nothing forwards a signal to its workers
    launcher.wait()
    deadline = time.monotonic() + 30
    while not stopped.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert stopped.exists() and stopped.read_text() == "SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_the_watch_sends_sigterm_once_the_parent_changes(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        done = threading.Event()
        watcher = threading.Thread(target=_watch_parent, args=(os.getppid() + 1, done, 0.01, 30.0))
        with contextlib.redirect_stderr(io.StringIO()) as err:
            watcher.start()
            deadline = time.monotonic() + 10
            while not received and time.monotonic() < deadline:
                time.sleep(0.01)
            done.set()  # the run stopped within the grace: no forced exit
            watcher.join(timeout=10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM] and not watcher.is_alive()
    assert "the launcher (pid" in err.getvalue() and "is gone: stopping" in err.getvalue()
