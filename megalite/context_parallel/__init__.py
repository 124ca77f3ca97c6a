"""Context parallelism: the sequence split across the cp ranks, for sequences too long for one rank.

    zigzag.py           the load-balanced split (rank i holds chunks i and 2cp-1-i), positions
    blocks.py           full / diagonal / skipped attention blocks, the ring plan, work per rank
    block_attention.py  one block's attention with its log-sum-exp; the online-softmax merge
    ring.py             ring attention (--cp-comm-type p2p): K/V round the ring, dK/dV back
    ulysses.py          Ulysses (--cp-comm-type a2a): all-to-all to a head split and back
    attention.py        the model's entry: one of the two, by name
    checks.py           what a configuration needs (torch-free, for the pre-flight)

Names load lazily (PEP 562), so `megalite.context_parallel.checks` imports without torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CP_COMM_TYPES": "checks", "attention_problems": "checks", "check_attention": "checks",
    "context_parallel_problems": "checks", "sequence_problems": "checks", "ulysses_head_problem": "checks",
    "LAYOUTS": "zigzag", "chunk_ids": "zigzag", "check_sequence_length": "zigzag", "gather_sequence": "zigzag",
    "position_ids": "zigzag", "split_sequence": "zigzag",
    "block_kind": "blocks", "causal_work": "blocks", "rank_block_counts": "blocks", "ring_plan": "blocks",
    "block_backward": "block_attention", "block_forward": "block_attention", "merge_block": "block_attention",
    "ring_attention": "ring", "ulysses_attention": "ulysses",
    "context_parallel_attention": "attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
