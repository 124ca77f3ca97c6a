"""PreemptionHandler and fault injection in one process (the multi-rank paths run in
test_resume_script.py: a SIGTERM to one rank, and a fault under torchrun)."""
import os
import signal

import pytest

from megalite.checkpoint import PreemptionHandler, maybe_inject_fault
from megalite.mesh import single_process_mesh


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
    # (the firing case, os._exit(1), is exercised under torchrun in test_resume_script.py)
    with pytest.raises(ValueError, match="check_interval"):
        PreemptionHandler(single_process_mesh("cpu"), check_interval=0)
