"""Data parallelism: the wrapper that owns parameters and gradients (contiguous buffers, buckets,
reductions overlapped with backward, parameter all-gathers overlapped with the next forward;
ZeRO-3: parameters sharded unit by unit, gathered right before each unit runs).

Names load lazily (PEP 562); `layout` is pure arithmetic.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.data_parallel.grad_buffers": ["DEFAULT_BUCKET_SIZE", "GradBuffers"],
    "megalite.data_parallel.layout": ["BufferLayout", "Bucket", "OwnedPiece", "ParamSlot", "build_layout"],
    "megalite.data_parallel.param_buffer": ["ParamBuffer", "ReadGuard"],
    "megalite.data_parallel.wrapper": ["DataParallel", "named_parameters_of"],
    "megalite.data_parallel.units": ["Unit", "default_units"],
    "megalite.data_parallel.unit_params": ["UnitParams"],
    "megalite.data_parallel.unit_grads": ["UnitGrads"],
    "megalite.data_parallel.zero3": ["UnitReadGuard", "Zero3Schedule"],
})
