"""Start, kill and restart the replica groups of a fault-tolerant run on this machine (tests and drills).

The launcher hosts the run's store (it outlives every group, as a job's rendezvous service would) in a
process of its own, forked before any group: a TCPStore server's thread resolves each connecting
peer's name (getnameinfo, under glibc's resolver lock), and a group forked while that thread held the
lock would wait on it forever in its own first connect. The launcher then starts each replica group's
W ranks as forked processes, a world of their own whose rank 0 serves its store (forked after one warm-up
build, so a restarted group is up in about 0.1 s plus its wait to be admitted, not the seconds of a cold
import), and supervises: when a rank of a group died (SIGKILL, here planned or random), its other ranks
leave on their own (their collectives inside the group fail; one still there after the run's timeout is
killed and recorded in `left`), and the group is restarted whole after `restart_delay_s` as a joining
group, which heals from a live peer at the next step boundary. A group ends in one line when it cannot
heal or the quorum is lost. `target` runs something else as each rank (trainer_groups.py: the training
program).
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

from megalite.fault_tolerance.group_stack import build_stack
from megalite.fault_tolerance.replica_group import ReplicaGroup
from megalite.fault_tolerance.settings import FaultTolerantRun, check_run
from megalite.fault_tolerance.store import serve
from megalite.replicas.membership import GroupBroken
from megalite.replicas.quorum import QuorumLost, RunFinished
from megalite.testing import free_port


class PlannedFault:
    """SIGKILL rank `rank` of its group at (step, moment): the seam ReplicaGroup calls at each moment."""

    def __init__(self, step: int, moment: str, rank: int = 0):
        self.step, self.moment, self.rank = step, moment, rank

    def __call__(self, step: int, moment: str) -> None:
        if (step, moment) == (self.step, self.moment):
            os.kill(os.getpid(), signal.SIGKILL)


def _group_main(run: FaultTolerantRun, group: int, position: int, joining: bool, fault, env: dict) -> None:
    os.environ.update(env)  # W > 1: this rank's place in its group's own world
    torch.set_num_threads(1)
    # `kill -USR1 <pid>`: every thread's stack, for a group that seems stuck (the process's own stderr:
    # a test's captured sys.stderr has no file descriptor)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__)
    try:
        ReplicaGroup(run, group, joining=joining, fault=fault, position=position).run()
    except QuorumLost as lost:
        if position == 0:
            print(f"megalite: {lost}", file=sys.stderr, flush=True)  # one line, no traceback
        sys.exit(1)
    except RunFinished as finished:
        if position == 0:
            print(f"megalite: {finished}", file=sys.stderr, flush=True)
    except GroupBroken as broken:  # a sibling is gone: leave at once (tearing down a broken world can abort)
        print(f"megalite: {broken}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)


def _exit_code(processes: list) -> int | None:
    """A group's exit: None while a rank runs; -9 when a rank was killed; else the first non-zero code."""
    codes = [p.exitcode for p in processes]
    if -signal.SIGKILL in codes:
        return -signal.SIGKILL
    if any(c is None for c in codes):
        return None
    return next((c for c in codes if c != 0), 0)


class Launcher:
    """The replica groups of `run` as processes of this machine (module docstring)."""

    def __init__(self, run: FaultTolerantRun, *, restart_delay_s: float = 0.5, target=None):
        """target(run, group, position, joining, fault, env): what each rank runs (default: ReplicaGroup's own
        training; `TrainerGroups`: the training program)."""
        check_run(run)
        self.target = target or _group_main
        port = run.store_port or free_port()
        ready = mp.get_context("fork").Event()
        self.store_server = mp.get_context("fork").Process(target=serve, args=(run.store_host, port, ready),
                                                           daemon=True)
        self.store_server.start()
        if not ready.wait(60):
            raise RuntimeError(f"the run's store did not start on {run.store_host}:{port} within 60 s")
        self.run = dataclasses.replace(run, store_port=port)
        Path(run.log_dir).mkdir(parents=True, exist_ok=True)
        self.restart_delay_s = restart_delay_s
        if target is None:  # warm: the forked groups start with megalite's lazy modules imported (~0.1 s)
            build_stack(dataclasses.replace(self.run, ranks_per_group=1))
        self.processes: dict[int, list[mp.Process]] = {}  # group -> its ranks' processes (this start)
        self.starts: dict[int, int] = {}
        self.kills: list[tuple[float, int]] = []  # (time, group) of every death seen
        self.left: list[tuple[int, int, int | None]] = []  # (group, rank, exit code) of a dead group's other
        # ranks: each left on its own (None: it did not within the run's timeout and was killed: a hang)

    def start(self, group: int, *, joining: bool = False, fault=None) -> None:
        """Start every rank of `group` (a world of its own, its rank 0 serving the world's store on a fresh
        port); `fault` goes to the rank it names (its `rank`, default 0)."""
        port, ranks = free_port(), self.run.ranks_per_group
        procs = []
        for s in range(ranks):
            env = {} if ranks == 1 else dict(RANK=str(s), LOCAL_RANK=str(s), WORLD_SIZE=str(ranks),
                                             LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR=self.run.store_host,
                                             MASTER_PORT=str(port))
            mine = fault if fault is not None and getattr(fault, "rank", 0) == s else None
            procs.append(mp.get_context("fork").Process(target=self.target, args=(self.run, group, s, joining, mine, env),
                                                        daemon=True))
            procs[-1].start()
        self.processes[group] = procs
        self.starts[group] = self.starts.get(group, 0) + 1

    def alive(self, group: int) -> bool:
        return all(p.is_alive() for p in self.processes[group])

    def kill(self, group: int, rank: int | None = None) -> None:
        """SIGKILL one rank of `group`, or all of them."""
        for s, process in enumerate(self.processes[group]):
            if (rank is None or s == rank) and process.is_alive():
                os.kill(process.pid, signal.SIGKILL)

    def _reap(self, group: int) -> None:
        """A rank of `group` was killed: wait for its other ranks to leave on their own (their collectives
        inside the group fail), killing (and recording) any still there after the run's timeout."""
        deadline = time.monotonic() + self.run.timeout_s + 5
        for s, process in enumerate(self.processes[group]):
            if process.exitcode == -signal.SIGKILL:
                continue
            process.join(max(deadline - time.monotonic(), 0.01))
            if process.exitcode is None:
                os.kill(process.pid, signal.SIGKILL)
                process.join()
                self.left.append((group, s, None))
            else:
                self.left.append((group, s, process.exitcode))

    def supervise(self, *, faults: dict[int, list] | None = None, timeout_s: float = 300.0,
                  on_poll=None, restart: bool = True) -> dict[int, int]:
        """Start every group (each with its first planned fault), restart each killed one whole (with its
        next; never with restart=False), until every group has exited; returns {group: exit code of its last
        start, -9 for one killed and not restarted}. `on_poll(launcher)` runs every poll (the chaos drill's
        random kills)."""
        pending = {g: list((faults or {}).get(g, [])) for g in range(self.run.groups)}
        for g in range(self.run.groups):
            self.start(g, fault=pending[g].pop(0) if pending[g] else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if on_poll is not None:
                on_poll(self)
            for g, procs in list(self.processes.items()):
                if _exit_code(procs) == -signal.SIGKILL and restart:
                    self.kills.append((time.time(), g))
                    self._reap(g)
                    time.sleep(self.restart_delay_s)  # the scheduler noticing and relaunching
                    self.start(g, joining=True, fault=pending[g].pop(0) if pending[g] else None)
            codes = {g: _exit_code(procs) for g, procs in self.processes.items()}
            if all(c is not None and (c != -signal.SIGKILL or not restart) for c in codes.values()):
                for g in codes:
                    self.kill(g)  # a killed group's other ranks, with restart=False
                self.store_server.kill()
                return codes
            time.sleep(0.02)
        for g in self.processes:
            self.kill(g)
        self.store_server.kill()
        raise TimeoutError(f"the run did not finish within {timeout_s:g} s")

    def records(self) -> list[dict]:
        out = []
        for path in sorted(Path(self.run.log_dir).glob("group*.rank*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out
