"""Tensor parallelism: region functions, parallel layers, vocab-parallel cross entropy, TP-aware RNG.

Names load lazily (PEP 562): importing one module of the package loads none of the others.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.tensor_parallel.cross_entropy": ["vocab_parallel_cross_entropy"],
    "megalite.tensor_parallel.layers": ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                                        "linear", "resolve_tp_group"],
    "megalite.tensor_parallel.mappings": [
        "copy_to_tensor_parallel_region", "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
        "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
        "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region"],
    "megalite.tensor_parallel.norms": ["LayerNorm", "RMSNorm"],
    "megalite.tensor_parallel.parallelize": ["parallelize", "Column", "Row", "Vocab", "Experts", "Heads", "PartialGrad",
                                             "ScatterSequence", "GatherSequence"],
    "megalite.tensor_parallel.plans": ["hf_plan"],
    "megalite.tensor_parallel.sequence_parallel": ["mark_sequence_parallel", "unmarked_norm_problem"],
    "megalite.tensor_parallel.random": ["TensorParallelRNG", "dropout"],
})
