"""megalite: Megatron-style tensor x pipeline x data parallel training in PyTorch and Triton."""

__version__ = "0.1.0"
