"""One simulated rank's world, in this process: torch's fake process group (`backend="fake"`: every
collective returns at once, moving nothing) and the meta device (tensors with a shape and no data),
so a 70B model's rank costs no memory and no FLOPs.

`fake_rank(rank, world_size)` is a context manager: inside it `megalite.distributed.mesh.init_mesh(...,
device=META)` builds that rank's groups with the real code (every group of the world, in the real
order). Nothing of megalite is replaced: the process group is made through `comm` with a
transport that moves nothing (`NoTransfer`: torch finds no backend for point-to-point transfers of
meta tensors, and the fake backend would move nothing anyway; comm's ledger counts every transfer
as on a real world). On exit everything global is as it was: the process group destroyed,
RANK / WORLD_SIZE restored, the communication ledger reset (a leaked ledger would add this rank's
bytes to whatever runs next in the process).
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch

from megalite.distributed import comm
from megalite.distributed.mesh import destroy_mesh

META = torch.device("meta")


class _DoneWork:
    """The handle of a point-to-point transfer that the fake world does not make."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class NoTransfer(comm.Transport):
    """comm's point-to-point transport in the fake world: every transfer done at once, nothing moved."""

    def batch_isend_irecv(self, ops: list) -> list:
        return [_DoneWork() for _ in ops]


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """Be global rank `rank` of a fake world of `world_size` processes until the block ends."""
    if comm.is_initialized():
        raise RuntimeError("a process group already exists in this process: the fake world needs its own")
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    comm.ledger.reset()
    try:
        comm.init_process_group("fake", rank, world_size, datetime.timedelta(minutes=30), transport=NoTransfer())
        yield
    finally:
        destroy_mesh()
        comm.ledger.reset()
        comm.ledger.ring.clear()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
