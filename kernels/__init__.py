"""Triton kernels, installed as `megalite.kernels` (filled by the kernels work)."""
