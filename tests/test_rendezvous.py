"""A fresh store namespace per start of the job: the handshake on a fake store (stale keys of
dead attempts, a missing rank), and real gloo worlds restarted three times against one
TCPStore server that outlives them, as torchrun's agent holds it."""
import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megalite.distributed import comm, mesh
from megalite.distributed.rendezvous import ROOT, RendezvousTimeout, attempt_namespace
from megalite.testing import free_port, run_distributed


class _DictStore:
    """set/get/check/add/wait over a dict, thread-safe (a TCPStore stand-in)."""

    def __init__(self):
        self.data, self._lock = {}, threading.Lock()

    def set(self, key, value):
        with self._lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        with self._lock:
            return self.data[key]

    def check(self, keys):
        with self._lock:
            return all(k in self.data for k in keys)

    def add(self, key, amount):
        with self._lock:
            self.data[key] = str(int(self.data.get(key, b"0")) + amount).encode()
            return int(self.data[key])

    def wait(self, keys, timeout):
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{keys} not set")
            time.sleep(0.001)


def _attempt(store, world_size, ranks=None, timeout_s=10.0, timeout_of=None):
    """Run the handshake on threads (one per rank); return {rank: namespace or the exception}.
    `timeout_of` maps a rank to its own timeout (default `timeout_s`)."""
    out, timeout_of = {}, timeout_of or {}

    def run(rank):
        try:
            out[rank] = attempt_namespace(store, rank, world_size, timeout_of.get(rank, timeout_s))
        except RendezvousTimeout as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (ranks if ranks is not None else range(world_size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_attempt_agrees_on_a_namespace_no_earlier_attempt_used():
    store, seen = _DictStore(), []
    for _ in range(3):
        namespaces = _attempt(store, 4)
        assert len(set(namespaces.values())) == 1, namespaces  # all ranks of the attempt agree
        seen.append(namespaces[0])
    assert len(set(seen)) == 3 and all(ns.startswith("megalite/") for ns in seen)
    # A dead attempt's hellos are still in the store (rank 3 died before rank 0 answered it):
    store.set(f"{ROOT}hello/3", "nonce-of-a-dead-process")
    assert len(set(_attempt(store, 4).values())) == 1


def test_a_rank_that_never_comes_is_named():
    out = _attempt(_DictStore(), 3, ranks=[0, 1], timeout_s=0.5)
    assert isinstance(out[0], RendezvousTimeout) and "ranks [2] did not reach the store within 0.5 s" in str(out[0])
    assert isinstance(out[1], RendezvousTimeout) and "rank 1: rank 0 did not answer" in str(out[1])
    store = _DictStore()
    store.set(f"{ROOT}hello/2", "nonce-of-a-dead-process")  # rank 2 came in an earlier attempt only
    # rank 1 waits longer than rank 0: its welcome must not race rank 0's answer on a loaded machine
    out = _attempt(store, 3, ranks=[0, 1], timeout_s=0.5, timeout_of={1: 30.0})
    assert isinstance(out[0], RendezvousTimeout) and "ranks [2] did not join" in str(out[0])
    assert isinstance(out[1], str)  # rank 1 was welcomed; rank 0 waits for rank 2 only


def _gloo_world(port):
    # As torchrun's workers see it: the agent, not rank 0, hosts the store at MASTER_PORT.
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    m = mesh.init_mesh(tp=1, pp=3)  # every rank creates 5 kinds of group: many store keys per attempt
    x = torch.full((2,), float(m.rank + 1))
    comm.all_reduce(x, comm.world_group())
    side = comm.side_channel_store()  # the hang watchdog's channel: this attempt's keys only
    stale = side.check([f"state/{m.rank}"])  # only this rank of an earlier world could have set it
    side.set(f"state/{m.rank}", "x")
    comm.barrier(comm.world_group())
    # wait, not check: each rank's set travels on its own store connection, which the gloo barrier
    # does not order (check raced it under load); a key that never arrives fails after 30 s
    side.wait([f"state/{r}" for r in range(3)], datetime.timedelta(seconds=30))
    return x.tolist(), stale, side.check([f"state/{r}" for r in range(3)])


def test_gloo_worlds_restart_against_a_store_that_outlives_them():
    """Without per-attempt namespaces the second world reads the first one's gloo addresses
    from the surviving server and dials dead ports (torch 2.13: 'connection refused')."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                                timeout=datetime.timedelta(seconds=30))
    for _ in range(3):
        assert run_distributed(_gloo_world, 3, port, timeout_s=120) == [([6.0, 6.0], False, True)] * 3
    assert agent_store.num_keys() > 0  # the earlier worlds' keys are all still there
