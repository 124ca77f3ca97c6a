"""Activation recompute that reproduces dropout masks.

megalite's dropout draws its Philox keys from the draw counters of `TensorParallelRNG`, not from
torch's global generators. Here the counters at the original forward are saved (a few Python
integers); the recompute in backward runs from them, so it draws the same keys and rebuilds
the same masks, and then puts back the counters it found, so later forwards (other
microbatches in a pipeline) are undisturbed.

torch's own RNG state is not saved (preserve_rng_state=False): megalite's blocks draw nothing
from the global generators, and the state would cost 5 KB per checkpoint on CPU. A function
that does use torch's global RNG must not be checkpointed with this.
"""
from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint

from megalite.tensor_parallel.random import TensorParallelRNG


def checkpoint_with_rng(fn: Callable, rng: TensorParallelRNG, *args):
    """fn(*args) whose activations are recomputed in backward with identical dropout masks."""
    saved = rng.counters()
    calls = {"n": 0}

    def run(*inner_args):
        calls["n"] += 1
        if calls["n"] == 1:  # the original forward: let the counters advance as usual
            return fn(*inner_args)
        current = rng.counters()
        rng.set_counters(saved)
        try:
            return fn(*inner_args)
        finally:
            rng.set_counters(current)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)
