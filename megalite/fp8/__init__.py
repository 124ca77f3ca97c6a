"""FP8 training: every tensor-parallel linear (and MoE expert) computes its three GEMMs in FP8.

- `recipe.py`   the format (e4m3, hybrid), scaling recipe (tensorwise, rowwise, blockwise) and scales of a run
- `scaling.py`  amax over the whole logical tensor (all-reduced over tp) and the casts
- `gemm.py`     the scaled GEMM: torch._scaled_mm, or the same maths dequantised where it has no kernel
- `linear.py`   the FP8 linear autograd functions (plain and sequence-parallel, FP8 on the wire)
- `blockwise.py`  DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 weight blocks
- `grouped.py`, `experts.py`  the MoE experts' grouped FP8 GEMMs
- `param_gather.py`  ZeRO-3's parameter all-gather in FP8 (--fp8-param-gather)

A built model's linears are switched to FP8 by megalite/model/fp8_convert.py (`convert_to_fp8`).
"""
from megalite.fp8.recipe import Fp8Recipe

__all__ = ["Fp8Recipe"]
