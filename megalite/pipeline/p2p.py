"""Pipeline point-to-point: who talks to whom, and posting one batch of transfers.

Routing is pure arithmetic shared by the verifier (which simulates it) and the executor
(which does it), so both agree by construction. Model chunk k = c*pp + r lives on rank r as
local chunk c (see partition.py); its successor k+1 is rank (r+1) % pp, local chunk
c + (r == pp-1); its predecessor k-1 is rank (r-1) % pp, local chunk c - (r == 0).

Transfers go through `megalite.comm.batch_isend_irecv` on the pipeline group: all ops of
one batch are posted together and the caller waits on all of them before computing again.
Shapes are known ahead (the caller passes the activation shape), so there is no shape
handshake, and nothing synchronises the whole device.
"""
from __future__ import annotations

from typing import Iterable

import torch

from megalite import comm
from megalite.pipeline.instructions import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, TRANSFER_KINDS


def is_first_chunk(pp: int, stage: int, chunk: int) -> bool:
    """Local chunk `chunk` on `stage` is model chunk 0 (it embeds the input ids)."""
    return stage == 0 and chunk == 0


def is_last_chunk(pp: int, v: int, stage: int, chunk: int) -> bool:
    """Local chunk `chunk` on `stage` is the last model chunk (it computes the loss)."""
    return stage == pp - 1 and chunk == v - 1


def peer(kind: str, pp: int, v: int, stage: int, chunk: int) -> tuple[int, int]:
    """(peer stage, peer local chunk) of a transfer instruction of `chunk` on `stage`.

    SEND_ACT / RECV_GRAD talk to the successor model chunk, RECV_ACT / SEND_GRAD to the
    predecessor. Raises ValueError when there is none (first chunk receiving activations...).
    """
    if kind in (SEND_ACT, RECV_GRAD):
        if is_last_chunk(pp, v, stage, chunk):
            raise ValueError(f"{kind} on the last model chunk (stage {stage}, chunk {chunk}): it has no successor")
        return (stage + 1) % pp, chunk + (stage == pp - 1)
    if kind in (RECV_ACT, SEND_GRAD):
        if is_first_chunk(pp, stage, chunk):
            raise ValueError(f"{kind} on the first model chunk (stage 0, chunk 0): it has no predecessor")
        return (stage - 1) % pp, chunk - (stage == 0)
    raise ValueError(f"not a transfer kind: {kind!r}; choose from {TRANSFER_KINDS}")


def post_and_wait(transfers: Iterable[tuple[str, torch.Tensor, int]], group) -> None:
    """Post ('send'|'recv', tensor, peer global rank) transfers as one batch and wait for all.

    Every op of the batch is in flight at once, so a send and a receive with the same peer
    (or with both neighbours) cannot deadlock against each other. Waiting only blocks the
    host on these handles (on CUDA the communication stream), never the whole device.
    """
    ops = [comm.P2P(op, tensor, peer_rank) for op, tensor, peer_rank in transfers]
    if ops:
        comm.wait_all(comm.batch_isend_irecv(ops, group))
