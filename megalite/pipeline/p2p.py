"""Pipeline point-to-point routing: who talks to whom (pure arithmetic, no torch).

Routing is pure arithmetic shared by the verifier (which simulates it) and the executor
(which does it), so both agree by construction. Model chunk k = c*pp + r lives on rank r as
local chunk c (see partition.py); its successor k+1 is rank (r+1) % pp, local chunk
c + (r == pp-1); its predecessor k-1 is rank (r-1) % pp, local chunk c - (r == 0).

The executor posts the transfers (`executor.post_and_wait`).
"""
from __future__ import annotations

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
