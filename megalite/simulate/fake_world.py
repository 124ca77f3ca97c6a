"""One simulated rank's world, in this process: torch's fake process group (`backend="fake"`,
its FakeStore: every collective returns at once, moving nothing) and the meta device (tensors
with a shape and no data), so a 70B model's rank costs no memory and no FLOPs.

`fake_rank(rank, world_size)` is a context manager: inside it `megalite.mesh.init_mesh` builds
that rank's groups with the real code (every group of the world, in the real order), and every
megalite object placed on `mesh.device` lands on the meta device. On exit everything global is
as it was: the process group destroyed, RANK / WORLD_SIZE restored, the communication ledger
reset (a leaked ledger would add this rank's bytes to whatever runs next in the process), the
patched functions put back.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megalite import comm, mesh as mesh_module

META = torch.device("meta")


class _DoneWork:
    """The handle of a point-to-point transfer that the fake world does not make."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _no_transfer(p2p_ops):
    """dist.batch_isend_irecv for meta tensors: torch finds no backend for the meta device, and the
    fake backend moves nothing anyway. comm has already counted every transfer in the ledger."""
    return [_DoneWork() for _ in p2p_ops]


@contextlib.contextmanager
def _patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """Be global rank `rank` of a fake world of `world_size` processes until the block ends."""
    if comm.is_initialized():
        raise RuntimeError("a process group already exists in this process: the fake world needs its own")
    saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    comm.ledger.reset()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(mesh_module, "default_device", lambda: META))
        stack.enter_context(_patched(dist, "batch_isend_irecv", _no_transfer))
        try:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            comm._GROUP_NAMES[dist.group.WORLD] = "world"
            yield
        finally:
            mesh_module.destroy_mesh()
            comm.ledger.reset()
            comm.ledger.ring.clear()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
