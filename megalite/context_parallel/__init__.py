"""Context parallelism: the sequence split across the cp ranks, for sequences too long for one rank.

    zigzag.py           the load-balanced split (rank i holds chunks i and 2cp-1-i), positions
    document_split.py   the per-document split (--cp-split documents: chunks i and 2cp-1-i of every document)
    blocks.py           full / diagonal / skipped attention blocks, the ring plan, work per rank
    block_attention.py  one block's attention with its log-sum-exp; the online-softmax merge
    documents.py        packed documents on the zigzag ring: the blocks to skip, each call's mask
    split_calls.py      packed documents on the ring under the per-document split: each document's boxes
    balance.py          how evenly each split spreads the masked work (host arithmetic)
    ring.py             ring attention (--cp-comm-type p2p): K/V round the ring, dK/dV back
    ulysses.py          Ulysses (--cp-comm-type a2a): all-to-all to a head split and back
    attention.py        the model's entry: one of the two, by name
    checks.py           what a configuration needs (torch-free, for the pre-flight)

Names load lazily (PEP 562), so `megalite.context_parallel.checks` imports without torch.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.context_parallel.checks": ["CP_COMM_TYPES", "attention_problems", "check_attention",
                                         "context_parallel_problems", "sequence_problems", "ulysses_head_problem"],
    "megalite.context_parallel.zigzag": ["LAYOUTS", "check_sequence_length", "chunk_ids", "gather_sequence",
                                         "position_ids", "split_sequence"],
    "megalite.context_parallel.document_split": ["SplitDocumentMask", "gather_tokens", "local_tokens",
                                                 "split_documents", "split_order"],
    "megalite.context_parallel.blocks": ["block_kind", "causal_work", "rank_block_counts", "ring_plan"],
    "megalite.context_parallel.block_attention": ["block_backward", "block_forward", "merge_block"],
    "megalite.context_parallel.ring": ["ring_attention"],
    "megalite.context_parallel.ulysses": ["ulysses_attention"],
    "megalite.context_parallel.attention": ["context_parallel_attention"],
})
