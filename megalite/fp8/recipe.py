"""What an FP8 run casts to and how it scales (Megatron's --fp8-format / --fp8-recipe names).

format   e4m3: every GEMM operand in float8_e4m3fn (max 448, 3 mantissa bits);
         hybrid: forward operands e4m3, gradients float8_e5m2 (max 57344, 2 mantissa bits: range
         for the gradients' wide spread, as Transformer Engine's HYBRID).
recipe   tensorwise: one scale per tensor, 448 / amax of the *whole logical tensor* (a shard over
         tp or sp takes its amax over the tp group, so every layout casts the same numbers);
         rowwise: one scale per row of each GEMM operand along the contraction dimension
         (torchao's rowwise: an outlier spoils one row, not the tensor);
         blockwise: 1 x 128 activation tiles and 128 x 128 weight blocks (DeepSeek-V3; megalite.fp8.blockwise).
scales   pow2 (default): each scale rounded down to a power of two, so an amax that moves by an
         ulp (another tp layout's summation order) leaves the cast unchanged (megalite.fp8.scaling);
         exact: max / amax as it comes (Transformer Engine's current scaling).

Current scaling only (the scale from this tensor's own amax, no history): nothing to checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config.choices import Fp8Format, Fp8Scales, Fp8ScalingRecipe


def _choice(kind, value, flag: str):
    """`value` as the enum `kind` (a member, or its string as a user types it); ValueError naming the flag."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(kind)}") from None


@dataclass(frozen=True)
class Fp8Recipe:
    """One run's FP8 choices (module docstring); strings are accepted and kept as the enums."""

    format: Fp8Format = Fp8Format.E4M3
    recipe: Fp8ScalingRecipe = Fp8ScalingRecipe.TENSORWISE
    scales: Fp8Scales = Fp8Scales.POW2

    def __post_init__(self):
        object.__setattr__(self, "format", _choice(Fp8Format, self.format, "--fp8-format"))
        object.__setattr__(self, "recipe", _choice(Fp8ScalingRecipe, self.recipe, "--fp8-recipe"))
        object.__setattr__(self, "scales", _choice(Fp8Scales, self.scales, "--fp8-scales"))

    @property
    def forward_dtype(self) -> torch.dtype:
        """Activations and weights."""
        return torch.float8_e4m3fn

    @property
    def grad_dtype(self) -> torch.dtype:
        """Output gradients (the backward GEMMs' left operand)."""
        return torch.float8_e5m2 if self.format is Fp8Format.HYBRID else torch.float8_e4m3fn

    @property
    def rowwise(self) -> bool:
        return self.recipe is Fp8ScalingRecipe.ROWWISE

    @property
    def blockwise(self) -> bool:
        return self.recipe is Fp8ScalingRecipe.BLOCKWISE

    @property
    def pow2_scales(self) -> bool:
        return self.scales is Fp8Scales.POW2

    def describe(self) -> str:
        return f"fp8 {self.format} {self.recipe}" + ("" if self.pow2_scales else " (exact scales)")


def recipe_from(cfg) -> Fp8Recipe | None:
    """The run's recipe from a RunConfig's precision settings; None without --fp8-format."""
    prec = cfg.precision
    if prec.fp8_format is None:
        return None
    return Fp8Recipe(prec.fp8_format, prec.fp8_recipe, prec.fp8_scales)
