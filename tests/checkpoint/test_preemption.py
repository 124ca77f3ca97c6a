"""PreemptionHandler and fault injection in one process (the multi-rank paths run in
test_resume_script.py: a SIGTERM to one rank, and a fault under torchrun)."""
import os
import signal

import pytest

from megalite.checkpoint import PreemptionHandler, maybe_inject_fault
from megalite.distributed.mesh import single_process_mesh


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_requests_a_stop_at_the_next_check(sig):
    before = signal.getsignal(sig)
    with PreemptionHandler(single_process_mesh("cpu"), check_interval=2) as handler:
        assert not handler.should_stop(2)
        os.kill(os.getpid(), sig)  # handled in this (main) thread: sets the flag, does not exit
        assert handler.requested_by == signal.Signals(sig).name
        assert not handler.should_stop(3)  # checked every 2 steps only
        assert handler.should_stop(4)
    assert signal.getsignal(sig) is before  # previous handler restored


def test_fault_fires_only_at_its_step_rank_and_first_attempt(monkeypatch):
    monkeypatch.setenv("MEGALITE_FAULT_AT_STEP", "3")
    monkeypatch.setenv("MEGALITE_FAULT_RANK", "1")
    maybe_inject_fault(2, 1)  # another step
    maybe_inject_fault(3, 0)  # another rank
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    maybe_inject_fault(3, 1)  # a restarted attempt runs through
    # (the firing cases, os._exit(1) and SIGKILL, are exercised under torchrun in test_resume_script.py)
    with pytest.raises(ValueError, match="check_interval"):
        PreemptionHandler(single_process_mesh("cpu"), check_interval=0)


def test_one_fault_per_attempt_and_a_real_signal(monkeypatch):
    monkeypatch.setenv("MEGALITE_FAULT_AT_STEP", "3,7")
    monkeypatch.setenv("MEGALITE_FAULT_RANK", "0,1")
    monkeypatch.setenv("MEGALITE_FAULT_SIGNAL", "SIGTERM")  # handled here: sets the preemption flag
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with PreemptionHandler(single_process_mesh("cpu")) as handler:
        maybe_inject_fault(3, 0)  # attempt 0's fault
        maybe_inject_fault(7, 0)  # attempt 1's fault is for rank 1
        assert handler.requested_by is None
        maybe_inject_fault(7, 1)
        assert handler.requested_by == "SIGTERM"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # past the list: runs through
    maybe_inject_fault(7, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("MEGALITE_FAULT_SIGNAL", "SIGSEGV")
    with pytest.raises(ValueError, match="use exit, SIGKILL or SIGTERM"):
        maybe_inject_fault(7, 1)
