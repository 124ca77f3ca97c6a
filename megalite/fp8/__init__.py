"""FP8 training: every tensor-parallel linear (and MoE expert) computes its three GEMMs in FP8.

- `recipe.py`   the format (e4m3, hybrid) and scaling recipe (tensorwise, rowwise) of a run
- `scaling.py`  amax over the whole logical tensor (all-reduced over tp) and the casts
- `gemm.py`     the scaled GEMM: torch._scaled_mm, or the same maths dequantised where it has no kernel
- `linear.py`   the FP8 linear autograd functions (plain and sequence-parallel, FP8 on the wire)
- `convert.py`  switching a built model's linears to FP8
- `param_gather.py`  ZeRO-3's parameter all-gather in FP8 (--fp8-param-gather)
"""
from megalite.fp8.recipe import Fp8Recipe

__all__ = ["Fp8Recipe"]
