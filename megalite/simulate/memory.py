"""What a simulated rank holds, counted storage by storage on data-less (meta) tensors.

`MemoryTracker` is a dispatch mode: every storage an op returns is counted once while it lives
(a weak finalizer takes it off), and `UntypedStorage.resize_` (ZeRO-3 frees and re-allocates a
unit's gathered parameters that way) moves the count, so `live` is this rank's allocated bytes
and `peak` their maximum: what torch.cuda.max_memory_allocated would say, less the allocator's
rounding. Alongside, autograd's saved-tensor hook counts the storages kept for backward (not
parameters) while they live: `saved_peak` is the activation peak the planner estimates.

A view allocates nothing, so a view op's outputs are never counted: their storage is counted where
it was made, or, where the tracker never saw it made, not at all. That is memory made below the
dispatcher: gloo's staging buffer for a reduce-scatter, handed back as split views when the work is
waited for (a GPU's NCCL has none). A tensor made from Python data (`torch.tensor`) shows as
`lift_fresh`, a view op that is counted; on the meta device not even that: it is counted at its first
op (an in-place collective, say).

A meta tensor has no value, so a read into Python (`.item()`, `.tolist()`) is answered here:
scalars read as 0 and truth values as True ("finite", "no overflow"), the answers of a healthy
step, so the step takes the path a real one takes (the optimizer updates; nothing is skipped);
a tensor copied to the host reads as ones (statistics divided by a count divide by one).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_aten = torch.ops.aten
_EMPTY = (_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default)


class _Counter:
    """Bytes of distinct live storages, with their running maximum; storages of at most `ignore_up_to`
    bytes count as 0."""

    def __init__(self, ignore_up_to: int = 0):
        self.sizes = WeakIdKeyDictionary()  # storage -> bytes counted for it
        self.live = 0
        self.peak = 0
        self.ignore_up_to = ignore_up_to

    def _counted(self, nbytes: int) -> int:
        return nbytes if nbytes > self.ignore_up_to else 0

    def add(self, storage) -> None:
        if storage in self.sizes:
            return
        n = self._counted(storage.nbytes())
        self.sizes[storage] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._drop, n, self)

    @staticmethod
    def _drop(n: int, counter: "_Counter") -> None:
        counter.live -= n

    def resized(self, storage, new_bytes: int) -> None:
        old = self.sizes.get(storage)
        if old is None:
            return
        new_bytes = self._counted(new_bytes)
        self.sizes[storage] = new_bytes
        # the finalizer subtracts the size at creation: keep the difference on the running count
        self.live += new_bytes - old
        self._drop_extra(storage, new_bytes - old)
        self.peak = max(self.peak, self.live)

    def _drop_extra(self, storage, delta: int) -> None:
        if delta:
            weakref.finalize(storage, self._drop, delta, self)


def _host_answer(tensor: torch.Tensor):
    """The value of a meta scalar read into Python (see the module's docstring)."""
    if tensor.dtype == torch.bool:
        return True
    return 0.0 if tensor.dtype.is_floating_point else 0


def _finite_values(func, out) -> None:
    """Real tensors whose kernels never ran (launches skipped): allocations filled with zeros, and
    every float result made finite (log(0) of a never-computed probability), so the step's checks
    pass as in a healthy real step. Values are not what this is for; bytes are."""
    if func in _EMPTY:
        out.zero_()
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and t.is_contiguous():
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)


class MemoryTracker(TorchDispatchMode):
    """Counts storages while active; `reset_peak()` starts a new maximum from what is live now.

    zero_fill: real tensors: every uninitialised allocation filled with zeros (module docstring).
    ignore_up_to: storages of at most this many bytes are left out of `all` (the simulation's grounding
    against the CPU allocator, where every Python number an op takes is an 8-byte host tensor)."""

    def __init__(self, zero_fill: bool = False, *, ignore_up_to: int = 0):
        super().__init__()
        self.zero_fill = zero_fill
        self.all = _Counter(ignore_up_to)
        self.saved = _Counter()
        self._exclude = WeakIdKeyDictionary()  # storages never counted as activations (parameters)
        self.sample = None  # a function of no arguments sampled after every op (its maximum: sampled_peak)
        self.sampled_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].is_meta:
            return _host_answer(args[0])
        if func is _aten._to_copy.default and args[0].is_meta and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type != "meta":  # .tolist(), .cpu(): ones of the shape
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func is _aten.bincount.default and args[0].is_meta:  # counts per value: [minlength] (values unknown)
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            out = torch.empty(minlength, dtype=torch.long, device=args[0].device)
        else:
            out = func(*args, **kwargs)
        if self.zero_fill:
            _finite_values(func, out)
        if not func.is_view or func is _aten.lift_fresh.default:  # see the module docstring on views
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.all.add(t.untyped_storage())
        if self.sample is not None:
            self.sampled_peak = max(self.sampled_peak, self.sample())
        return out

    def exclude_from_activations(self, tensors) -> None:
        for t in tensors:
            self._exclude[t.untyped_storage()] = True

    def reset_peak(self) -> None:
        self.all.peak = self.all.live
        self.saved.peak = self.saved.live

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage not in self._exclude and not isinstance(tensor, torch.nn.Parameter):
            self.all.add(storage)  # made before the tracker started: counted from now on
            self.saved.add(storage)
        return tensor

    @contextlib.contextmanager
    def active(self):
        """Count storages (and resizes, and saved activations) inside the block."""
        original_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize(storage, nbytes):
            result = original_resize(storage, nbytes)
            tracker.all.resized(storage, int(nbytes))
            return result

        torch.UntypedStorage.resize_ = resize
        try:
            with self, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            torch.UntypedStorage.resize_ = original_resize
