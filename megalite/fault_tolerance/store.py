"""The run's key-value store of a fault-tolerant run: a TCPStore that outlives every replica group.

    python -m megalite.fault_tolerance.store HOST:PORT      # serves until killed (--ft-store HOST:PORT)

Served by a process of its own, never by a process that later forks: a TCPStore server's thread resolves
each connecting peer's name (getnameinfo, under glibc's resolver lock), and a process forked while that
thread held the lock waits on it forever in its own first connect (the launcher forks its groups).
"""
from __future__ import annotations

import sys
import time

import torch.distributed as dist


def serve(host: str, port: int, ready=None) -> None:
    """Serve the store at host:port until this process ends; `ready.set()` once it listens."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)  # noqa: F841 - serves while alive
    if ready is not None:
        ready.set()
    while True:
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    host, _, port = (args[0] if len(args) == 1 else "").rpartition(":")
    if not host or not port.isdigit():
        print("megalite: usage: python -m megalite.fault_tolerance.store HOST:PORT (the address the replica "
              "groups' --ft-store names)", file=sys.stderr)
        return 2
    print(f"megalite: the run's store serves on {host}:{port}", flush=True)
    serve(host, int(port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
