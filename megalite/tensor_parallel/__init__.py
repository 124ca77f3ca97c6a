"""Tensor parallelism: region functions, parallel layers, vocab-parallel cross entropy, TP-aware RNG."""
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             linear, resolve_tp_group)
from megalite.tensor_parallel.mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                               gather_from_tensor_parallel_region,
                                               reduce_from_tensor_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from megalite.tensor_parallel.random import TensorParallelRNG, dropout

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "linear", "resolve_tp_group", "TensorParallelRNG", "dropout",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
]
