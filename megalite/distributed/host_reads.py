"""No tensor value may reach the host inside forward or backward (a step the host never holds back).

On a GPU, reading a tensor's value into Python (`t.item()`, `bool(t)`, `int(t)`, `t.tolist()`,
a host copy) waits for every kernel queued before it: the host stops issuing work and the GPU
queue drains. Inside a CUDA-graph capture the same read is an error. So megalite reads losses,
norms and checks once per step, after the microbatches' forward and backward (train_step's
`float(loss_sum)`, the optimizer's grad norm); nothing between may.

`no_host_reads()` enforces that on any device, CPU included (where every tensor is "on the
host", the rule is about reading VALUES into Python): inside it,

- the Python entry points `Tensor.item`, `tolist`, `numpy`, `__bool__`, `__int__`, `__float__`,
  `__index__` raise `HostReadError`;
- a dispatch mode rejects what reads values below Python too: `aten._local_scalar_dense` (what
  every scalar read becomes, whoever calls it, C++ included), `aten.nonzero` and
  `aten.masked_select` (output sizes known only after a sync), and copies of a non-CPU tensor
  to the CPU.

train_step(..., check_host_reads=True) runs its forwards and backwards under it (the tests do;
`--cuda-graph` does on its warm-ups), so a read planted in a block's forward fails.

The Python entry points are patched process-wide, not per thread: on a GPU the backward runs on
the autograd engine's device threads, which a per-thread check would miss. So is any other
thread's read while the block runs (only the tests and a capture's warm-up enter it).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReadError(RuntimeError):
    """A tensor's value was read into Python inside forward or backward."""


_PYTHON_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select")


def _refuse(what: str):
    raise HostReadError(f"{what} reads a tensor's value on the host inside forward/backward; keep it on the "
                        f"device (torch.where, a device tensor) or read it after the step")


class _SyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS:
            _refuse(f"aten.{name}")
        if name in ("_to_copy", "copy_") and _to_host(name, args, kwargs or {}):
            _refuse(f"a device-to-host aten.{name}")
        return func(*args, **(kwargs or {}))


def _to_host(name: str, args, kwargs) -> bool:
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type not in ("cpu", "meta")
    source, device = args[0], kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and source.device.type not in ("cpu", "meta")


@contextlib.contextmanager
def no_host_reads(python_entry_points: bool = True):
    """Within this block, reading a tensor's value into Python raises HostReadError (see above).

    python_entry_points=False keeps only the dispatch-level check: on a GPU it alone catches every
    read of a device tensor (each ends in aten._local_scalar_dense or a device-to-host copy), is
    thread-local (the autograd engine carries it to its device threads) and so never trips on
    another thread's reads of host tensors; --cuda-graph's warm-up uses that."""
    if not python_entry_points:
        with _SyncingOps():
            yield
        return
    originals = {name: getattr(torch.Tensor, name) for name in _PYTHON_READS}

    def forbidden(name):
        def read(self, *args, **kwargs):
            _refuse(f"Tensor.{name}")
        return read

    for name in _PYTHON_READS:
        setattr(torch.Tensor, name, forbidden(name))
    try:
        with _SyncingOps():
            yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
