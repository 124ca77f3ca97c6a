"""ZeRO-3 schedule: when each unit's full parameters are gathered and freed, when its gradient is reduced.

A *pass* is one forward of one model chunk (and later its backward). Within a pass, units
start one after another as *entries*:

Forward
- The chunk's forward pre-hook opens the pass, turns the read guard on and starts the
  gathers of the first `prefetch` units of the chunk's execution order.
- A unit starts at its module's forward pre-hook, or at the first read of one of its
  parameters (`UnitReadGuard`). It becomes the current entry: its gather is waited for and
  the next `prefetch` units of the execution order are gathered in the background (the order
  is recorded during the chunk's first training forward; before that, the declared one).
- Starting a unit ends the previous entry: its parameters are freed (reshard after forward),
  or kept until that entry's backward (`reshard_after_forward=False`).
- A read of another unit's parameter while an entry runs (GPT-2's tied head reading the word
  embedding, a user's direct weight access) gathers that unit on demand instead of reading
  freed storage: the entry *borrows* it, frees it with itself and gathers it again for its
  backward. A module-started unit none of whose inputs needs a gradient cannot mark the
  point where its backward begins, so it is borrowed the same way (always correct).
- The chunk's forward post-hook ends the last entry and closes the pass.

Backward, entry by entry in reverse:
- pre-backward of entry k, when the gradient of its output is complete (a hook on the input
  tensors of entry k+1, or on the chunk's output for the last entry): gather the unit and
  what it borrowed, start the gathers of the `prefetch` entries before it. Activation
  recompute runs the unit's forward inside its backward, on these gathered parameters.
- post-backward of entry k, when the gradient of its inputs is complete: free, and start
  the reduce-scatter of its gradient (the autograd engine has run every accumulation of the
  unit's parameters by then). Zero-bubble B passes defer the weight gradients: those units
  reduce after their W pass (`after_weight_grads`).
- An autograd-engine callback at the end of the backward finishes the entries no hook saw
  (the first one, whose input ids need no gradient) and reduces what the pass borrowed.

Everything is reference counted in `UnitParams` (forward scope, awaiting backward, backward,
prefetch, whole step with `keep_gathered_in_step`), so pipelines with many microbatches in
flight share one gather when their holds overlap and free it when the last lets go.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megalite.parameters import params as P
from megalite.data_parallel.unit_grads import UnitGrads
from megalite.data_parallel.unit_params import UnitParams
from megalite.data_parallel.units import Unit


@dataclass
class _Entry:
    unit: int
    borrowed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # holds for the forward scope (unit + borrowed)
    awaiting: list[int] = field(default_factory=list)  # kept gathered until this entry's backward
    backward: list[int] = field(default_factory=list)  # holds for its backward
    state: str = "forward"  # forward -> ended -> backward -> done


@dataclass
class _Pass:
    chunk: int
    grad: bool
    entries: list[_Entry] = field(default_factory=list)
    sequence: list[int] = field(default_factory=list)  # units in the order they were first used
    prefetched: dict[int, int] = field(default_factory=dict)  # unit -> prefetch holds not yet consumed
    cursor: int = -1  # position in the chunk's execution order
    callback_queued: bool = False
    # its multi-grad hooks, removed when its backward ends: each holds the grad_fn of the tensors it
    # watches, which (through the graph's edges) holds the stage's received input: a reference cycle
    # through autograd's C++ nodes that kept every microbatch's input alive after its backward
    grad_hooks: list = field(default_factory=list)

    def current(self) -> _Entry | None:
        return self.entries[-1] if self.entries and self.entries[-1].state == "forward" else None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for value in (*args, *kwargs.values()):
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(item, torch.Tensor):
                out.append(item)
    return out


def _grad_tensors(value) -> list[torch.Tensor]:
    items = value if isinstance(value, (list, tuple)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class Zero3Schedule:
    """Hooks and holds of ZeRO-3 (see the module docstring). Built by `DataParallel(zero_stage=3)`."""

    def __init__(self, units: Sequence[Unit], chunks: Sequence[nn.Module], params: UnitParams, grads: UnitGrads, *,
                 prefetch: int = 1, reshard_after_forward: bool = True, keep_gathered_in_step: bool = False):
        if prefetch < 0:
            raise ValueError(f"zero3 prefetch must be >= 0 units, got {prefetch}")
        self.units, self.params, self.grads = list(units), params, grads
        self.prefetch, self.reshard, self.keep = prefetch, reshard_after_forward, keep_gathered_in_step
        self.unit_of_param = {id(p): u for u, unit in enumerate(self.units) for p in unit.params}
        self.order = [[u for u, unit in enumerate(self.units) if unit.chunk == c] for c in range(len(chunks))]
        self._recorded = [False] * len(chunks)
        self._stack: list[_Pass] = []  # passes whose forward is running, innermost last
        self._passes: list[_Pass] = []  # training passes whose backward has not finished
        self._step_held: set[int] = set()
        self._fallback: list[int] = []  # holds taken inside a backward no entry covered
        self.guard = UnitReadGuard(self)
        self._hooks = []
        for c, chunk in enumerate(chunks):
            self._hooks.append(chunk.register_forward_pre_hook(self._chunk_hook(c, True), with_kwargs=True))
            self._hooks.append(chunk.register_forward_hook(self._chunk_hook(c, False), always_call=True))
        for u, unit in enumerate(self.units):
            for module in unit.modules:
                self._hooks.append(module.register_forward_pre_hook(self._unit_hook(u), with_kwargs=True))

    # ------------------------------------------------------------------ holds

    def _acquire(self, p: _Pass | None, unit: int) -> None:
        self.params.acquire(unit)
        if p is not None and p.prefetched.get(unit):  # the prefetch's hold turns into this one
            p.prefetched[unit] -= 1
            self.params.release(unit)
        if self.keep and p is not None and p.grad and unit not in self._step_held:  # (not grad mode: off
            # inside an autograd Function's forward, where a layer may read a weight)
            self._step_held.add(unit)
            self.params.acquire(unit)

    def _prefetch(self, p: _Pass, units: Sequence[int]) -> None:
        for unit in units:
            if not p.prefetched.get(unit):
                self.params.acquire(unit)
                p.prefetched[unit] = 1

    def _release_prefetched(self, p: _Pass) -> None:
        for unit, count in p.prefetched.items():
            for _ in range(count):
                self.params.release(unit)
        p.prefetched.clear()

    # ------------------------------------------------------------------ forward

    def _chunk_hook(self, chunk: int, opening: bool):
        def open_pass(_module, _args, _kwargs):
            p = _Pass(chunk, torch.is_grad_enabled())
            if not self._stack:
                self.guard.__enter__()
            self._stack.append(p)
            self._prefetch(p, self.order[chunk][:self.prefetch])

        def close_pass(_module, _args, output):
            p = self._stack.pop()
            if not self._stack:
                self.guard.__exit__(None, None, None)
            self._close(p, output)

        return open_pass if opening else close_pass

    def _unit_hook(self, unit: int):
        def start(_module, args, kwargs):
            if _in_backward():  # activation recompute: the entry's backward holds it already
                self._backward_read(unit)
                return
            p = self._pass_of(unit)
            current = p.current()
            if current is not None and (current.unit == unit or unit in current.borrowed):
                return
            boundary = [t for t in _tensors(args, kwargs) if t.requires_grad] if p.grad else []
            if current is None or not p.grad or boundary:
                if current is not None:
                    self._end_entry(p, current)
                self._start_entry(p, unit)
                if boundary:
                    self._mark_boundary(p, len(p.entries) - 1, boundary)
            else:
                self._borrow(p, current, unit)
        return start

    def _pass_of(self, unit: int) -> _Pass:
        for p in reversed(self._stack):
            if p.chunk == self.units[unit].chunk:
                return p
        raise RuntimeError(f"ZeRO-3 unit {self.units[unit].name!r} ran outside its model chunk's forward; call the "
                           f"model (or pipeline chunk) itself, whose hooks gather the units")

    def on_read(self, unit: int) -> None:
        """A parameter of `unit` is read during a forward (from the read guard)."""
        if _in_backward():
            self._backward_read(unit)
            return
        p = self._stack[-1]
        current = p.current()
        if current is None:
            self._start_entry(p, unit)
        elif unit == current.unit or unit in current.borrowed:
            self.params.wait(unit)
        else:
            self._borrow(p, current, unit)

    def _start_entry(self, p: _Pass, unit: int) -> None:
        entry = _Entry(unit, held=[unit])
        self._acquire(p, unit)
        self.params.wait(unit)
        p.entries.append(entry)
        p.sequence.append(unit)
        order = self.order[p.chunk]
        if unit in order[p.cursor + 1:]:
            p.cursor = order.index(unit, p.cursor + 1)
            self._prefetch(p, order[p.cursor + 1:p.cursor + 1 + self.prefetch])

    def _borrow(self, p: _Pass, entry: _Entry, unit: int) -> None:
        self._acquire(p, unit)
        self.params.wait(unit)
        entry.borrowed.append(unit)
        entry.held.append(unit)
        p.sequence.append(unit)

    def _end_entry(self, p: _Pass, entry: _Entry) -> None:
        entry.state = "ended"
        if p.grad and not self.reshard:
            entry.awaiting, entry.held = entry.held, []
            return
        for unit in entry.held:
            self.params.release(unit)
        entry.held = []

    def _close(self, p: _Pass, output) -> None:
        current = p.current()
        if current is not None:
            self._end_entry(p, current)
        self._release_prefetched(p)
        if p.grad and not self._recorded[p.chunk] and p.sequence:
            self.order[p.chunk] = [u for i, u in enumerate(p.sequence) if i == 0 or u != p.sequence[i - 1]]
            self._recorded[p.chunk] = True
        outputs = _grad_tensors(output) if p.grad else []
        if outputs and p.entries:
            last = len(p.entries) - 1
            p.grad_hooks.append(torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads: self._pre_backward(p, last)))
            self._passes.append(p)
        else:  # no backward will come: nothing stays gathered for it
            for entry in p.entries:
                self._finish_entry(entry, reduce=False)

    def _mark_boundary(self, p: _Pass, index: int, inputs: list[torch.Tensor]) -> None:
        """Entry `index`'s inputs: their gradient completes its backward and starts the one before.

        An input that is a leaf (a pipeline stage's received activation) gets its gradient in an
        accumulation node, which the engine may run before the accumulations of the unit's own
        parameters (same priority): such an entry's backward is finished by the end callback."""
        leaf = any(t.grad_fn is None for t in inputs)

        def boundary(_grads):
            if not leaf:
                self._post_backward(p, index)
            if index > 0:
                self._pre_backward(p, index - 1)
        if index > 0 or not leaf:
            p.grad_hooks.append(torch.autograd.graph.register_multi_grad_hook(inputs, boundary))

    # ------------------------------------------------------------------ backward

    def _pre_backward(self, p: _Pass, index: int) -> None:
        if not p.callback_queued:
            p.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(p))
        entry = p.entries[index]
        if entry.state in ("backward", "done"):
            return
        entry.state = "backward"
        for unit in [entry.unit, *entry.borrowed]:
            self._acquire(p, unit)
            entry.backward.append(unit)
        for unit in entry.backward:
            self.params.wait(unit)
        before = [e.unit for e in reversed(p.entries[max(0, index - self.prefetch):index]) if e.state == "ended"]
        self._prefetch(p, before)

    def _post_backward(self, p: _Pass, index: int) -> None:
        entry = p.entries[index]
        if entry.state != "done":
            self._finish_entry(entry, reduce=True)

    def _finish_entry(self, entry: _Entry, reduce: bool) -> None:
        entry.state = "done"
        for unit in entry.held + entry.awaiting + entry.backward:
            self.params.release(unit)
        entry.held, entry.awaiting, entry.backward = [], [], []
        if reduce:
            self._reduce(entry.unit)

    def _reduce(self, unit: int) -> None:
        if not any(P.deferred(param) is not None for param in self.units[unit].params):
            self.grads.reduce(unit)

    def _end_backward(self, p: _Pass) -> None:
        for index in reversed(range(len(p.entries))):
            self._post_backward(p, index)
        self._release_prefetched(p)
        for unit in set(p.sequence):  # what the pass borrowed and no entry of its own reduced
            self._reduce(unit)
        if p in self._passes:
            self._passes.remove(p)
        self._remove_grad_hooks(p)
        self._release_fallback()

    @staticmethod
    def _remove_grad_hooks(p: _Pass) -> None:
        for handle in p.grad_hooks:
            handle.remove()
        p.grad_hooks.clear()

    def _backward_read(self, unit: int) -> None:
        """A unit's forward (recompute) or parameter read inside a backward: make sure it is gathered."""
        if not self.params.is_gathered(unit) or self.params.holds[unit] == 0:
            if not self._fallback:
                torch.autograd.Variable._execution_engine.queue_callback(self._release_fallback)
            self.params.acquire(unit)
            self._fallback.append(unit)
        self.params.wait(unit)

    def _release_fallback(self) -> None:
        held, self._fallback = self._fallback, []
        for unit in held:
            self.params.release(unit)

    # ------------------------------------------------------------------ step boundaries

    def after_weight_grads(self, chunk: int) -> None:
        """A zero-bubble W pass of `chunk` delivered its deferred weight gradients: reduce them."""
        for u, unit in enumerate(self.units):
            if unit.chunk == chunk and self.grads.has_gradient(u):
                self._reduce(u)

    def end_step(self) -> None:
        """Before the optimizer: drop the step's holds (keep-gathered-in-step, passes whose
        backward never ran); afterwards no unit is gathered."""
        for p in self._passes:
            for entry in p.entries:
                if entry.state != "done":
                    self._finish_entry(entry, reduce=False)
            self._release_prefetched(p)
            self._remove_grad_hooks(p)
        self._passes.clear()
        self._release_fallback()
        for unit in self._step_held:
            self.params.release(unit)
        self._step_held.clear()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


_METADATA = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.register_hook,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.grad.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__, torch.Tensor._base.__get__,
    torch.Tensor.layout.__get__,
})  # reads of a tensor's description, not of its values: they need no gather


class UnitReadGuard(TorchFunctionMode):
    """On during every chunk forward: any torch function, tensor method or attribute read whose
    tensor arguments (one level deep) are a unit's parameter, or a view of one, first makes
    the unit available (`Zero3Schedule.on_read`). Inside this handler the mode is off."""

    def __init__(self, schedule: Zero3Schedule):
        super().__init__()
        self.schedule = schedule
        self.unit_of_param = schedule.unit_of_param

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            for value in (*args, *kwargs.values()):
                for item in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(item, torch.Tensor):
                        unit = self.unit_of_param.get(id(item))
                        if unit is None and item._base is not None:
                            unit = self.unit_of_param.get(id(item._base))
                        if unit is not None:
                            self.schedule.on_read(unit)
        return func(*args, **kwargs)
