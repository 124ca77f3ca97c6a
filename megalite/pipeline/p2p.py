"""Pipeline point-to-point routing: who talks to whom (pure arithmetic, no torch).

Routing is pure arithmetic shared by the verifier (which simulates it) and the executor
(which does it), so both agree by construction. Model chunk k's successor is model chunk k+1
and its predecessor k-1, wherever the placement puts them (partition.py): under Megatron's
interleaving (model chunk k = c*pp + r on rank r) the successor of rank r's local chunk c is
rank (r+1) % pp, local chunk c + (r == pp-1); under DualPipeV's V placement it is the next
rank down for local chunk 0, the next rank up for local chunk 1, and on rank pp-1 local
chunk 0's successor is its own local chunk 1: a *local hop*, no transfer at all (the
executor hands the output over in memory; `is_local_hop`).

The executor posts the transfers (`executor.post_and_wait`).
"""
from __future__ import annotations

from megalite.pipeline.instructions import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, TRANSFER_KINDS
from megalite.pipeline.partition import ChunkPlacement, chunk_location, model_chunk_id

INTERLEAVED = ChunkPlacement.INTERLEAVED


def is_first_chunk(pp: int, stage: int, chunk: int) -> bool:
    """Local chunk `chunk` on `stage` is model chunk 0 (it embeds the input ids; the same under
    every placement)."""
    return stage == 0 and chunk == 0


def is_last_chunk(pp: int, v: int, stage: int, chunk: int, placement: ChunkPlacement = INTERLEAVED) -> bool:
    """Local chunk `chunk` on `stage` is the last model chunk (it computes the loss)."""
    return model_chunk_id(pp, stage, chunk, placement) == pp * v - 1


def last_chunk_location(pp: int, v: int, placement: ChunkPlacement = INTERLEAVED) -> tuple[int, int]:
    """(stage, local chunk) of the last model chunk: (pp-1, v-1), or (0, 1) under the V placement."""
    return chunk_location(pp, pp * v - 1, placement)


def peer(kind: str, pp: int, v: int, stage: int, chunk: int,
         placement: ChunkPlacement = INTERLEAVED) -> tuple[int, int]:
    """(peer stage, peer local chunk) of a transfer instruction of `chunk` on `stage`.

    SEND_ACT / RECV_GRAD talk to the successor model chunk, RECV_ACT / SEND_GRAD to the
    predecessor. Raises ValueError when there is none (first chunk receiving activations...).
    The peer may be `stage` itself under the V placement (see `is_local_hop`).
    """
    k = model_chunk_id(pp, stage, chunk, placement)
    if kind in (SEND_ACT, RECV_GRAD):
        if k == pp * v - 1:
            raise ValueError(f"{kind} on the last model chunk (stage {stage}, chunk {chunk}): it has no successor")
        return chunk_location(pp, k + 1, placement)
    if kind in (RECV_ACT, SEND_GRAD):
        if k == 0:
            raise ValueError(f"{kind} on the first model chunk (stage 0, chunk 0): it has no predecessor")
        return chunk_location(pp, k - 1, placement)
    raise ValueError(f"not a transfer kind: {kind!r}; choose from {TRANSFER_KINDS}")


def is_local_hop(kind: str, pp: int, v: int, stage: int, chunk: int, placement: ChunkPlacement = INTERLEAVED) -> bool:
    """The transfer `kind` of (stage, chunk) would go to the same stage: the neighbour model chunk
    is a local chunk of this rank (DualPipeV's turn at rank pp-1), so nothing is sent; False where
    there is no neighbour in that direction."""
    k = model_chunk_id(pp, stage, chunk, placement)
    if (kind in (SEND_ACT, RECV_GRAD) and k == pp * v - 1) or (kind in (RECV_ACT, SEND_GRAD) and k == 0):
        return False
    return peer(kind, pp, v, stage, chunk, placement)[0] == stage
