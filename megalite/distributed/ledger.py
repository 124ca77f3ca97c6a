"""What megalite's communication did: bytes, calls and seconds per (group name, op), and a ring
buffer of the most recent ops (what a hang report prints: "rank 5 waits in all_reduce on group dp").

`megalite.distributed.comm` keeps the one `Ledger` of this process (`comm.ledger`) and writes every op into it;
this module only holds the records. Bytes counted per op are the payload of one rank in nccl-tests
terms (see megalite/distributed/comm.py).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class OpRecord:
    seq: int
    op: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    start: float
    end: float | None = None  # None while the call has not returned (or an async op is pending)
    cuda: bool = False  # the op's tensor is on a GPU: the call returns once enqueued, long before completion
    done_event: Any = None  # CUDA ops: an event recorded after the op; query() tells whether it completed

    def describe(self) -> str:
        state = "in progress" if self.end is None else f"done in {1e3 * (self.end - self.start):.2f} ms"
        return f"#{self.seq} {self.op} group={self.group} shape={list(self.shape)} {self.dtype} ({state})"


class Ledger:
    """Bytes, call counts and host-side seconds per (group name, op) since the last reset."""

    def __init__(self, ring_size: int = 128):
        self._lock = threading.Lock()
        self.bytes: dict[tuple[str, str], int] = collections.defaultdict(int)
        self.calls: dict[tuple[str, str], int] = collections.defaultdict(int)
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.ring: collections.deque[OpRecord] = collections.deque(maxlen=ring_size)
        self._seq = 0

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.calls.clear()
            self.seconds.clear()

    def begin(self, op: str, group_name: str, tensor: torch.Tensor, nbytes: int) -> OpRecord:
        with self._lock:
            self._seq += 1
            record = OpRecord(self._seq, op, group_name, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                              nbytes, time.perf_counter(), cuda=tensor.is_cuda)
            self.ring.append(record)
            self.bytes[(group_name, op)] += nbytes
            self.calls[(group_name, op)] += 1
            return record

    def end(self, record: OpRecord) -> None:
        if record.cuda:  # the current stream waits for the op from here: the event fires when it is done
            record.done_event = torch.cuda.Event()
            record.done_event.record()
        record.end = time.perf_counter()
        with self._lock:
            self.seconds[(record.group, record.op)] += record.end - record.start

    def total_bytes(self, group: str | None = None, op: str | None = None) -> int:
        return sum(n for (g, o), n in self.bytes.items() if (group is None or g == group) and (op is None or o == op))

    def snapshot(self) -> dict[str, int]:
        """{'group/op': bytes} for metrics files."""
        return {f"{g}/{o}": n for (g, o), n in sorted(self.bytes.items())}
