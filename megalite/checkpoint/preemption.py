"""Preemption: SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) -> checkpoint at the next step boundary and exit 0.

A signal usually reaches one rank first (or only one: a node being drained). The handler
only sets a flag; at every step boundary `should_stop()` all-reduces the flag (max of one
float over the world: 4 bytes, negligible next to a training step), so every rank stops
after the same step, saves the same checkpoint, and exits cleanly. A second signal while
stopping is ignored; the scheduler's SIGKILL after its grace period still ends the job.
The flag is the signal's number, so rank 0 names the signal in its one stop line.

Before the first step there is no step boundary to wait for: `interrupt_during_setup()` makes
the same signals raise `SetupInterrupted` at once (the entry point prints one line and exits
128 + the signal's number, as a shell reports a process killed by it; nothing was trained).

Fault injection for restart tests: `MEGALITE_FAULT_AT_STEP=k` makes one rank
(`MEGALITE_FAULT_RANK`, default the last) exit(1) (or, with `MEGALITE_FAULT_SIGNAL`, get a
real SIGKILL/SIGTERM) at the start of step k, but only on the first attempt under torchrun
(TORCHELASTIC_RESTART_COUNT unset or 0), so the restarted job runs through; `k1,k2,...`
faults attempt i at step k_i (repeated failures).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

import torch

from megalite.distributed import comm
from megalite.distributed.mesh import Mesh

FAULT_STEP_ENV, FAULT_RANK_ENV, FAULT_SIGNAL_ENV = "MEGALITE_FAULT_AT_STEP", "MEGALITE_FAULT_RANK", "MEGALITE_FAULT_SIGNAL"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class SetupInterrupted(Exception):
    """A stop signal arrived before training started: the run ends now, having trained nothing."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} during set-up (before the first step): stopped, nothing "
                         f"trained or saved")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# Python runs a signal handler only between bytecodes of the main thread: one blocked in C (a
# rendezvous waiting for a rank that already exited, a collective, a large read) would not see the
# signal until that call returns, and the launcher kills it after its grace period. The C-level
# handler still writes the signal's number to the wakeup fd at once: a thread reading it ends the
# process itself when the main thread has not stopped within SETUP_STOP_GRACE_S.
SETUP_STOP_GRACE_S = 1.0


@contextlib.contextmanager
def interrupt_during_setup(signals=STOP_SIGNALS):
    """Within the block, `signals` raise SetupInterrupted (in the main thread; elsewhere a no-op); a
    main thread blocked in C is ended by a watcher thread (its one line, exit 128 + the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise SetupInterrupted(signum)

    previous = {sig: signal.signal(sig, _raise) for sig in signals}
    left = threading.Event()
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    watcher = threading.Thread(target=_end_if_blocked, args=(reader, left, _raise), daemon=True,
                               name="megalite-setup-signals")
    watcher.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        writer.close()  # wakes the watcher: it sees `left` and returns
        watcher.join(timeout=5)
        reader.close()


def _end_if_blocked(reader: socket.socket, left: threading.Event, handler) -> None:
    """The watcher: for each stop signal that reached this process while `handler` (set-up's) handles it,
    give the main thread SETUP_STOP_GRACE_S to raise SetupInterrupted, then print its line and exit."""
    while not left.is_set():
        try:
            received = reader.recv(64)
        except OSError:
            return
        if not received:
            return
        for signum in received:
            if signum not in [int(s) for s in STOP_SIGNALS] or signal.getsignal(signum) is not handler:
                continue
            if left.wait(SETUP_STOP_GRACE_S):
                return
            stopped = SetupInterrupted(signum)
            if os.environ.get("RANK", "0") == "0" or os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"megalite: {stopped}", file=sys.stderr, flush=True)
            os._exit(stopped.exit_code)


class PreemptionHandler:
    """Catch `signals` (default SIGTERM, SIGUSR1 and SIGINT) and agree on a stop step across ranks.

    check_interval: all-reduce the flag every K steps (1: every step). install=False: the
    handlers are set by `install()` later (the training loop: once set-up is over). Use as a
    context manager, or call `close()` to restore the previous handlers.
    """

    def __init__(self, mesh: Mesh, signals=STOP_SIGNALS, check_interval: int = 1, install: bool = True):
        if check_interval < 1:
            raise ValueError(f"check_interval must be >= 1, got {check_interval}")
        self.mesh, self.check_interval, self.signals = mesh, check_interval, tuple(signals)
        self.requested_by: str | None = None  # name of the first signal received on this rank
        self.agreed_signal: str | None = None  # after should_stop() is True: the signal named on every rank
        self._previous = {}
        if install:
            self.install()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and not self._previous:  # main thread only
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # silent: rank 0 says once, at the stop, which signal
        if self.requested_by is None:
            self.requested_by = signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        """True on every rank once any rank has received a signal (checked every check_interval steps)."""
        if step % self.check_interval:
            return False
        number = int(signal.Signals[self.requested_by]) if self.requested_by else 0
        flag = torch.tensor([float(number)], device=self.mesh.device)
        comm.all_reduce(flag, comm.world_group(), op="max")
        if flag.item() > 0:
            self.agreed_signal = signal.Signals(int(flag.item())).name
        return bool(flag.item() > 0)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# A worker whose launcher died (torchrun's agent killed with SIGKILL, its node's session gone) would
# train on unsupervised and hold the --save lock, so the restart is refused. The watcher sees the
# parent change (the orphan is re-parented) and sends this process SIGTERM: a preemption, saved at
# the next step boundary; one that cannot reach it (a peer gone mid-collective) ends after the grace.
LAUNCHER_POLL_S, LAUNCHER_GONE_GRACE_S = 0.5, 120.0


@contextlib.contextmanager
def end_with_the_launcher(poll_s: float = LAUNCHER_POLL_S, grace_s: float = LAUNCHER_GONE_GRACE_S):
    """Within the block, a process started by a launcher (LOCAL_RANK set: torchrun, or a forked test world)
    gets SIGTERM when its parent dies, and exits after `grace_s` more if it has not stopped by then."""
    parent = os.getppid()
    if "LOCAL_RANK" not in os.environ or parent == 1:
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(target=_watch_parent, args=(parent, done, poll_s, grace_s), daemon=True,
                               name="megalite-launcher-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=5)


def _watch_parent(parent: int, done: threading.Event, poll_s: float, grace_s: float) -> None:
    while not done.wait(poll_s):
        if os.getppid() == parent:
            continue
        print(f"megalite (rank {os.environ.get('RANK', '0')}): the launcher (pid {parent}) is gone: stopping "
              f"(a checkpoint is saved at the next step boundary when --save is given)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        if not done.wait(grace_s):
            os._exit(128 + signal.SIGTERM)
        return


def _per_attempt(name: str) -> list[str]:
    """The comma-separated entries of env var `name`; entry i is for TORCHELASTIC_RESTART_COUNT == i."""
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


def maybe_inject_fault(step: int, rank: int) -> None:
    """Kill the chosen rank at the start of `step` when MEGALITE_FAULT_AT_STEP asks for it.

    MEGALITE_FAULT_AT_STEP=5 faults the first attempt at step 5; "5,7" also the first restart
    at step 7 (entry i is for TORCHELASTIC_RESTART_COUNT == i, and later attempts run through).
    MEGALITE_FAULT_RANK (default: the last rank) takes a value or such a list too.
    MEGALITE_FAULT_SIGNAL: "exit" (default: exit code 1), "SIGKILL" or "SIGTERM" (a real
    signal to this process; SIGTERM is then a preemption: save and stop).
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    steps = _per_attempt(FAULT_STEP_ENV)
    if attempt >= len(steps) or int(steps[attempt]) != step:
        return
    ranks = _per_attempt(FAULT_RANK_ENV) or [str(int(os.environ.get("WORLD_SIZE", "1")) - 1)]
    if rank != int(ranks[min(attempt, len(ranks) - 1)]):
        return
    how = os.environ.get(FAULT_SIGNAL_ENV, "exit")
    if how not in ("exit", "SIGKILL", "SIGTERM"):
        raise ValueError(f"{FAULT_SIGNAL_ENV}={how!r}: use exit, SIGKILL or SIGTERM")
    print(f"megalite: fault injection: rank {rank} {'exits' if how == 'exit' else 'gets ' + how} at step {step} "
          f"({FAULT_STEP_ENV})", file=sys.stderr, flush=True)
    if how == "exit":
        os._exit(1)
    os.kill(os.getpid(), getattr(signal, how))
