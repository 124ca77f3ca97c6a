"""RoPE's cos/sin tables for a model config, with its frequency scaling (config/rope_scaling.py).

config/rope_scaling.py stays torch-free (GPTConfig checks its dict without loading torch); the torch
half of the rule lives here, next to the tables it feeds.
"""
from __future__ import annotations

import math

import torch

from megalite.config.rope_scaling import rope_type


def scale_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """inv_freq [d/2] (fp32) -> the frequencies RoPE uses under `scaling` (unchanged for plain RoPE);
    the llama3 rule of rope_scaling.py's docstring."""
    if rope_type(scaling) == "default":
        return inv_freq
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, scaled)
    return torch.where(wavelength < context / high, inv_freq, scaled)


def rope_tables(seq_length: int, head_dim: int, theta: float, device=None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, d] in fp32 for rotate-half RoPE (each frequency's angle repeated in both halves);
    `scaling`: GPTConfig.rope_scaling, None for plain RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    inv_freq = scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    return angles.cos(), angles.sin()
