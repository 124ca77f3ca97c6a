"""Data parallelism: contiguous fp32 gradient buffers, buckets, dp reduction overlapped with backward."""
from megalite.data_parallel.grads import DEFAULT_BUCKET_SIZE, DataParallelGrads
from megalite.data_parallel.layout import BufferLayout, Bucket, OwnedPiece, ParamSlot, build_layout

__all__ = ["DEFAULT_BUCKET_SIZE", "DataParallelGrads", "BufferLayout", "Bucket", "OwnedPiece", "ParamSlot",
           "build_layout"]
