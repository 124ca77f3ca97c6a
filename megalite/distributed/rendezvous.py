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
then lives under `megalite/<token>/`. Cost: ranks > 0 block in the store's own wait (no
polling); rank 0 reads all hellos in one multi_get per round, with a growing pause between
rounds, so a large job does not flood the store.

Works on any object with the Store API's set/get/check/add/wait (torch's TCPStore, or a
dict-backed fake in tests); nothing here imports torch.
"""
from __future__ import annotations

import datetime
import time
import uuid

ROOT = "megalite/attempt/"


class RendezvousTimeout(RuntimeError):
    """Some ranks of this start of the job never reached the store within the timeout."""


def _text(value) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def attempt_namespace(store, rank: int, world_size: int, timeout_s: float) -> str:
    """The key prefix every rank of this start of the job uses ('megalite/<token>/').

    Every rank must call it once, right after connecting to the job's store, before any other
    key is written. Raises RendezvousTimeout naming the missing ranks after `timeout_s`.
    """
    if world_size == 1:
        return f"megalite/{uuid.uuid4().hex}/"
    if rank == 0:
        token = uuid.uuid4().hex
        _welcome_everyone(store, token, world_size, timeout_s)
        return f"megalite/{token}/"
    nonce = uuid.uuid4().hex
    store.set(f"{ROOT}hello/{rank}", nonce)
    welcome = f"{ROOT}welcome/{nonce}"
    try:
        store.wait([welcome], datetime.timedelta(seconds=timeout_s))  # blocks in the store, no polling
    except (RuntimeError, TimeoutError):
        raise RendezvousTimeout(f"rank {rank}: rank 0 did not answer within {timeout_s:g} s; is rank 0 running, "
                                f"with the same MASTER_ADDR/MASTER_PORT as this rank?") from None
    token = _text(store.get(welcome))
    store.set(f"{ROOT}{token}/joined/{rank}", "1")
    store.add(f"{ROOT}{token}/joined", 1)
    return f"megalite/{token}/"


def _get_all(store, keys: list[str]) -> list[str]:
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return [_text(v) for v in values]


def _welcome_everyone(store, token: str, world_size: int, timeout_s: float) -> None:
    """Rank 0: answer hellos until world_size - 1 ranks have joined under `token`."""
    hellos = [f"{ROOT}hello/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    try:  # every rank has said hello at least once (maybe only a dead attempt's hello so far)
        store.wait(hellos, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError):
        missing = [r for r, key in enumerate(hellos, 1) if not store.check([key])]
        raise RendezvousTimeout(f"rank 0: ranks {missing[:16]} did not reach the store within {timeout_s:g} s "
                                f"(launched? same MASTER_ADDR/MASTER_PORT?)") from None
    answered: list[str | None] = [None] * len(hellos)  # per rank, the last nonce answered
    pause = 0.001
    while store.add(f"{ROOT}{token}/joined", 0) < world_size - 1:
        for i, nonce in enumerate(_get_all(store, hellos)):
            if nonce != answered[i]:
                store.set(f"{ROOT}welcome/{nonce}", token)
                answered[i] = nonce
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world_size) if not store.check([f"{ROOT}{token}/joined/{r}"])]
            raise RendezvousTimeout(f"rank 0: ranks {missing[:16]} did not join within {timeout_s:g} s (launched? "
                                    f"same MASTER_ADDR/MASTER_PORT?)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
