"""Activation recompute that reproduces dropout masks.

`torch.utils.checkpoint` restores the global RNG, but megalite's dropout draws from the
explicit generators of `TensorParallelRNG`. Here the generators' state at the original
forward is captured; the recompute in backward runs from that state and then puts back the
state it found, so later forwards (other microbatches in a pipeline) are undisturbed.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megalite.tensor_parallel.random import TensorParallelRNG


def checkpoint_with_rng(fn: Callable, rng: TensorParallelRNG, *args):
    """fn(*args) whose activations are recomputed in backward with identical dropout masks."""
    saved_state = rng.get_state()
    calls = {"n": 0}

    def run(*inner_args):
        calls["n"] += 1
        if calls["n"] == 1:  # the original forward: let the generators advance as usual
            return fn(*inner_args)
        current = rng.get_state()
        rng.set_state(saved_state)
        try:
            return fn(*inner_args)
        finally:
            rng.set_state(current)

    return checkpoint(run, *args, use_reentrant=False)
