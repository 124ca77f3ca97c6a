"""Where the weight gradients of megalite's linear layers go.

Column/Row-parallel linears compute their weight (and bias) gradients in their own
autograd backward. Three destinations, chosen per parameter and per backward:

1. Plain autograd (default): the gradient is returned and lands in `param.grad`.
2. A gradient sink: a data-parallel wrapper attaches one (`megalite.parameters.params.set_grad_destination`)
   to accumulate straight into its contiguous fp32 main-grad buffer and mark the bucket ready,
   skipping the `param.grad` round trip (Megatron's gradient-accumulation fusion).
3. Deferred (zero-bubble pipelines, ZB-H1): inside `defer_weight_grads(store, key, params)`
   the backward of those parameters' layers computes only the input gradient (the "B" pass)
   and queues a closure per layer; `store.run(key)` later computes and delivers the weight
   gradients (the "W" pass). The deferral is recorded on the parameters themselves
   (`megalite.parameters.params`), so there is no module-level stack.

Contract for other parameters (norms, embeddings): autograd accumulates them into
`param.grad`; a DP wrapper catches those with `register_post_accumulate_grad_hook`.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Hashable, Iterable

import torch

from megalite.parameters import params as P


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
def defer_weight_grads(store: WeightGradStore, key: Hashable, parameters: Iterable[torch.Tensor]):
    """Within this block, the linear layers owning `parameters` queue their weight gradients on `store`."""
    parameters = list(parameters)
    for param in parameters:
        P.set_deferred(param, (store, key))
    try:
        yield store
    finally:
        for param in parameters:
            P.set_deferred(param, None)


def deliver(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand a computed weight gradient to the parameter's sink, or accumulate it in `.grad`."""
    sink = P.grad_sink(param)
    if sink is not None:
        sink(param, grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def route_weight_grads(weight, bias, compute: Callable, *args) -> None:
    """Deliver `compute(*args)`'s (grad_weight, grad_bias) now, or queue it under the weight's
    deferral store (zero-bubble schedules run it later as the W pass)."""
    deferred = P.deferred(weight)
    if deferred is not None:
        store, key = deferred
        store.put(key, lambda: _deliver_both(weight, bias, *compute(*args)))
    else:
        _deliver_both(weight, bias, *compute(*args))


def _deliver_both(weight, bias, grad_weight, grad_bias) -> None:
    if grad_weight is not None:
        deliver(weight, grad_weight)
    if grad_bias is not None:
        deliver(bias, grad_bias)


def bypasses_autograd(param: torch.Tensor | None) -> bool:
    """True when this parameter's gradient must not be returned to autograd.

    Ask it of the parameter itself, kept on the autograd node's ctx, never of the saved tensor that
    `ctx.saved_tensors` returns: under a saved-tensor hook (activation offloading, `--simulate`'s
    memory count) that is another Python object, without the sink or deferral declared on the
    parameter, and the gradient would go to `.grad` instead of the data-parallel engine."""
    return param is not None and (P.deferred(param) is not None or P.grad_sink(param) is not None)
