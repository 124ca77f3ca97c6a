"""A fresh key namespace for every start of the job, agreed through the job's key-value store.

Why it is needed. Under torchrun the store the workers reach at MASTER_ADDR:MASTER_PORT is a
TCPStore server held by the elastic agent, not by a worker, so it outlives a failed attempt
and keeps every key that attempt wrote:

- default c10d rendezvous (`--standalone`, `--rdzv-backend c10d`): the agent shares its own
  server with the workers (`DynamicRendezvousHandler.use_agent_store` is True unless
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and creates it once, on the first rendezvous
  (`_shared_tcp_store_server`), then hands every later attempt the same address;
- `--master-port P` (static rendezvous): the agent hosts the server at P for its lifetime, and
  `StaticTCPRendezvous.use_agent_store` is always True, whatever the variable says.

The workers' env:// init then connects as a plain client (torch/distributed/rendezvous.py,
`_create_c10d_store`: "We create a new TCPStore for every retry so no need to add prefix for
each attempt", which is untrue of a shared server), so the restarted gloo group finds its
peers' address keys already set by the dead attempt, reads them before the live peers
overwrite them, and dials dead ports ("connection refused") until torchrun gives up.

A prefix from TORCHELASTIC_RESTART_COUNT separates attempts on one node but not on several:
an agent whose own workers look healthy restarts them *without* counting a restart when
another node rejoins the rendezvous (agent/server/api.py, `_invoke_run`: "membership changes
do not count as retries"), so two nodes of one attempt can carry different counts. The
namespace is therefore agreed through the store itself, in a way that cannot read a value an
earlier attempt left:

    rank r > 0:  set hello/r = a fresh random nonce; wait for welcome/<nonce> (the token);
                 then mark <token>/joined/r and add 1 to <token>/joined
    rank 0:      draw a fresh random token; answer each hello/r whose nonce it has not answered
                 yet with welcome/<nonce> = token, until <token>/joined counts world_size - 1

A stale hello (left by a dead attempt) is answered too, harmlessly: nobody waits for that
welcome. Only live ranks can join under a token drawn a moment ago. Every key of the attempt
then lives under `megalite/<token>/`.

Works on any object with the Store API's set/get/check/add (torch's TCPStore, or a dict-backed
fake in tests); nothing here imports torch.
"""
from __future__ import annotations

import time
import uuid

ROOT = "megalite/attempt/"


class RendezvousTimeout(RuntimeError):
    """Some ranks of this start of the job never reached the store within the timeout."""


def _text(value) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def attempt_namespace(store, rank: int, world_size: int, timeout_s: float, poll_s: float = 0.005) -> str:
    """The key prefix every rank of this start of the job uses ('megalite/<token>/').

    Every rank must call it once, right after connecting to the job's store, before any other
    key is written. Raises RendezvousTimeout naming the missing ranks after `timeout_s`.
    """
    if world_size == 1:
        return f"megalite/{uuid.uuid4().hex}/"
    if rank == 0:
        token = uuid.uuid4().hex
        _welcome_everyone(store, token, world_size, timeout_s, poll_s)
    else:
        nonce = uuid.uuid4().hex
        store.set(f"{ROOT}hello/{rank}", nonce)
        token = _wait_for(store, f"{ROOT}welcome/{nonce}", timeout_s, poll_s,
                          f"rank {rank}: rank 0 did not answer within {timeout_s:.0f} s; is rank 0 running and "
                          f"MASTER_ADDR/MASTER_PORT the same for every rank?")
        store.set(f"{ROOT}{token}/joined/{rank}", "1")
        store.add(f"{ROOT}{token}/joined", 1)
    return f"megalite/{token}/"


def _wait_for(store, key: str, timeout_s: float, poll_s: float, message: str) -> str:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):  # check() never blocks; get() would, with the store's own timeout
        if time.monotonic() > deadline:
            raise RendezvousTimeout(message)
        time.sleep(poll_s)
    return _text(store.get(key))


def _welcome_everyone(store, token: str, world_size: int, timeout_s: float, poll_s: float) -> None:
    """Rank 0: answer hellos until world_size - 1 ranks have joined under `token`."""
    answered: dict[int, str] = {}  # rank -> the last nonce answered (maybe a dead attempt's)
    deadline = time.monotonic() + timeout_s
    while store.add(f"{ROOT}{token}/joined", 0) < world_size - 1:
        for rank in range(1, world_size):
            key = f"{ROOT}hello/{rank}"
            if store.check([key]):
                nonce = _text(store.get(key))
                if answered.get(rank) != nonce:
                    store.set(f"{ROOT}welcome/{nonce}", token)
                    answered[rank] = nonce
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world_size) if not store.check([f"{ROOT}{token}/joined/{r}"])]
            raise RendezvousTimeout(f"rank 0: ranks {missing[:16]} did not join within {timeout_s:.0f} s (launched? "
                                    f"same MASTER_ADDR/MASTER_PORT?)")
        time.sleep(poll_s)
