"""RoPE's cos/sin tables for a model config, with its frequency scaling (config/rope_scaling.py).

config/rope_scaling.py stays torch-free (GPTConfig checks its dict without loading torch); the torch
half of the rule lives here, next to the tables it feeds.
"""
from __future__ import annotations

import math

import torch

from megalite.config.rope_scaling import rope_type, yarn_attention_factor


def _yarn_frequencies(inv_freq: torch.Tensor, scaling: dict, theta: float) -> torch.Tensor:
    """YaRN's blend of f and f/factor along the dimension index (config/rope_scaling.py)."""
    half, factor = inv_freq.shape[0], float(scaling["factor"])
    dim, context = 2 * half, float(scaling["original_max_position_embeddings"])

    def turning_dim(rotations: float) -> float:  # the dimension whose wave turns `rotations` times over L
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(float(scaling.get("beta_fast") or 32)), turning_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(half, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)  # ramp 0: the fast waves keep f


def scale_frequencies(inv_freq: torch.Tensor, scaling: dict | None, theta: float = 10000.0) -> torch.Tensor:
    """inv_freq [d/2] (fp32) -> the frequencies RoPE uses under `scaling` (unchanged for plain RoPE);
    the llama3 rule of rope_scaling.py's docstring."""
    if rope_type(scaling) == "default":
        return inv_freq
    if rope_type(scaling) == "yarn":
        return _yarn_frequencies(inv_freq, scaling, theta)
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
    `scaling`: GPTConfig.rope_scaling, None for plain RoPE (YaRN's tables carry its attention factor)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    inv_freq = scale_frequencies(inv_freq, scaling, theta)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, d]
    if rope_type(scaling) == "yarn":  # YaRN scales the rotated vectors' magnitude
        magnitude = yarn_attention_factor(scaling)
        return angles.cos() * magnitude, angles.sin() * magnitude
    return angles.cos(), angles.sin()
