"""Start, kill and restart the replica groups of a fault-tolerant run on this machine (tests and drills).

The launcher hosts the run's store (it outlives every group, as a job's rendezvous service would) in a
process of its own, forked before any group: a TCPStore server's thread resolves each connecting
peer's name (getnameinfo, under glibc's resolver lock), and a group forked while that thread held the
lock would wait on it forever in its own first connect. The launcher then starts each replica group as a forked process (forked after one warm-up build, so a restarted group
is up in about 0.1 s plus its wait to be admitted, not the seconds of a cold import), and supervises: a group that died (SIGKILL, here
planned or random) is restarted after `restart_delay_s` as a joining group, which heals from a live
peer at the next step boundary. A group ends in one line when it cannot heal or the quorum is lost.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.fault_tolerance.quorum import QuorumLost, RunFinished
from megalite.fault_tolerance.replica_group import ReplicaGroup, build_stack
from megalite.fault_tolerance.settings import FaultTolerantRun, check_run
from megalite.testing import free_port


class PlannedFault:
    """SIGKILL this process at (step, moment): the seam ReplicaGroup calls at each moment."""

    def __init__(self, step: int, moment: str):
        self.step, self.moment = step, moment

    def __call__(self, step: int, moment: str) -> None:
        if (step, moment) == (self.step, self.moment):
            os.kill(os.getpid(), signal.SIGKILL)


def _serve_store(host: str, port: int, ready) -> None:
    """The run's store server, alone in its process until the launcher ends it."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)  # noqa: F841 - serves while alive
    ready.set()
    while True:
        time.sleep(3600)


def _group_main(run: FaultTolerantRun, group: int, joining: bool, fault) -> None:
    torch.set_num_threads(1)
    # `kill -USR1 <pid>`: every thread's stack, for a group that seems stuck (the process's own stderr:
    # a test's captured sys.stderr has no file descriptor)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__)
    try:
        ReplicaGroup(run, group, joining=joining, fault=fault).run()
    except QuorumLost as lost:
        print(f"megalite: {lost}", file=sys.stderr, flush=True)  # one line, no traceback
        sys.exit(1)
    except RunFinished as finished:
        print(f"megalite: {finished}", file=sys.stderr, flush=True)


class Launcher:
    """The replica groups of `run` as processes of this machine (module docstring)."""

    def __init__(self, run: FaultTolerantRun, *, restart_delay_s: float = 0.5):
        check_run(run)
        port = run.store_port or free_port()
        ready = mp.get_context("fork").Event()
        self.store_server = mp.get_context("fork").Process(target=_serve_store, args=(run.store_host, port, ready),
                                                           daemon=True)
        self.store_server.start()
        if not ready.wait(60):
            raise RuntimeError(f"the run's store did not start on {run.store_host}:{port} within 60 s")
        self.run = dataclasses.replace(run, store_port=port)
        Path(run.log_dir).mkdir(parents=True, exist_ok=True)
        self.restart_delay_s = restart_delay_s
        build_stack(self.run)  # warm: the forked groups start with megalite's lazy modules imported (~0.1 s)
        self.processes: dict[int, mp.Process] = {}
        self.starts: dict[int, int] = {}
        self.kills: list[tuple[float, int]] = []  # (time, group) of every death seen

    def start(self, group: int, *, joining: bool = False, fault=None) -> None:
        process = mp.get_context("fork").Process(target=_group_main, args=(self.run, group, joining, fault),
                                                 daemon=True)
        process.start()
        self.processes[group] = process
        self.starts[group] = self.starts.get(group, 0) + 1

    def kill(self, group: int) -> None:
        process = self.processes[group]
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)

    def supervise(self, *, faults: dict[int, list] | None = None, timeout_s: float = 300.0,
                  on_poll=None, restart: bool = True) -> dict[int, int]:
        """Start every group (each with its first planned fault), restart each killed one (with its next;
        never with restart=False), until every group has exited; returns {group: exit code of its last
        process, -9 for one killed and not restarted}. `on_poll(launcher)` runs every poll (the chaos
        drill's random kills)."""
        pending = {g: list((faults or {}).get(g, [])) for g in range(self.run.groups)}
        for g in range(self.run.groups):
            self.start(g, fault=pending[g].pop(0) if pending[g] else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if on_poll is not None:
                on_poll(self)
            for g, process in list(self.processes.items()):
                if process.exitcode == -signal.SIGKILL and restart:
                    self.kills.append((time.time(), g))
                    time.sleep(self.restart_delay_s)  # the scheduler noticing and relaunching
                    self.start(g, joining=True, fault=pending[g].pop(0) if pending[g] else None)
            if all(p.exitcode is not None and (p.exitcode != -signal.SIGKILL or not restart)
                   for p in self.processes.values()):
                self.store_server.kill()
                return {g: p.exitcode for g, p in self.processes.items()}
            time.sleep(0.02)
        for g in self.processes:
            self.kill(g)
        self.store_server.kill()
        raise TimeoutError(f"the run did not finish within {timeout_s:g} s")

    def records(self) -> list[dict]:
        out = []
        for g in range(self.run.groups):
            path = Path(self.run.log_dir) / f"group{g}.jsonl"
            if path.is_file():
                out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out
