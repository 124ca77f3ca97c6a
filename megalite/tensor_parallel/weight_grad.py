"""Where the weight gradients of megalite's linear layers go.

Column/Row-parallel linears compute their weight (and bias) gradients in their own
autograd backward. Three destinations, chosen per parameter and per backward:

1. Plain autograd (default): the gradient is returned and lands in `param.grad`.
2. A gradient sink: a data-parallel engine sets `param.grad_sink = fn(param, grad)` to
   accumulate straight into its contiguous fp32 `main_grad` buffer and mark the bucket ready,
   skipping the `param.grad` round trip (Megatron's gradient-accumulation fusion).
3. Deferred (zero-bubble pipelines, ZB-H1): inside `defer_weight_grads(store, key)` the
   backward computes only the input gradient (the "B" pass) and queues a closure per layer;
   `store.run(key)` later computes and delivers the weight gradients (the "W" pass).

Contract for other parameters (norms, embeddings): autograd accumulates them into
`param.grad`; a DP engine catches those with `register_post_accumulate_grad_hook`.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Hashable

import torch

_ACTIVE: list[tuple["WeightGradStore", Hashable]] = []  # innermost deferral context last


class WeightGradStore:
    """Queues of deferred weight-gradient computations, keyed (e.g. by (chunk, microbatch))."""

    def __init__(self):
        self._queues: dict[Hashable, list[Callable[[], None]]] = defaultdict(list)

    def put(self, key: Hashable, fn: Callable[[], None]) -> None:
        self._queues[key].append(fn)

    def run(self, key: Hashable) -> int:
        """Compute and deliver every weight gradient queued under `key`; return how many.

        Under no_grad: the closures run outside the autograd engine (which computes gradients
        with grad mode off), on saved activations that require grad; with grad mode on, each
        weight gradient would carry a graph back to them, the gradient buffers it is added
        into would too, and through the optimizer's state every step's graph would be kept."""
        fns = self._queues.pop(key, [])
        with torch.no_grad():
            for fn in fns:
                fn()
        return len(fns)

    def pending(self) -> list[Hashable]:
        return list(self._queues)


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore, key: Hashable):
    """Within this block, linear layers' backward queue their weight gradients on `store`."""
    _ACTIVE.append((store, key))
    try:
        yield store
    finally:
        _ACTIVE.pop()


def active_store() -> tuple[WeightGradStore, Hashable] | None:
    return _ACTIVE[-1] if _ACTIVE else None


def deliver(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand a computed weight gradient to the parameter's sink, or accumulate it in `.grad`."""
    sink = getattr(param, "grad_sink", None)
    if sink is not None:
        sink(param, grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def bypasses_autograd(param: torch.Tensor | None) -> bool:
    """True when this parameter's gradient must not be returned to autograd."""
    return param is not None and (active_store() is not None or getattr(param, "grad_sink", None) is not None)
