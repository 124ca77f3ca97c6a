"""RoPE frequency scaling for long contexts (Llama 3.1's "llama3" rule): its torch-free checks.

`GPTConfig.rope_scaling` holds HF's dict (`rope_type` plus its numbers); plain RoPE is None.
"llama3" and "yarn" are built: any other type is refused by name (check_rope_scaling), never approximated.

The llama3 rule (Meta's Llama 3.1 release) keeps the high frequencies, divides the low ones by
`factor`, and blends linearly in between, judged by each frequency's wavelength 2*pi/f against
the original context length L: wavelength < L/high_freq_factor -> f; wavelength > L/low_freq_factor
-> f/factor; else (1 - t) * f/factor + t * f with t = (L/wavelength - low) / (high - low).
The rule itself (torch) is model/rope.py's scale_frequencies.

YaRN (Peng et al. 2023; DeepSeek-V2/V3's long context): frequencies whose dimension index i (of d/2) lies
below the correction range [low, high] keep f, those above it become f/factor, a linear ramp blends
between; low/high are the dimensions that turn beta_fast / beta_slow times over the original context L:
dim(r) = d * ln(L / (2 pi r)) / (2 ln theta), floored/ceiled (truncate, the default) and clamped to
[0, d-1]. The tables' cos and sin are multiplied by the attention factor (`yarn_attention_factor`),
and DeepSeek's MLA multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim)^2.
"""
from __future__ import annotations

import math

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor")


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict) -> None:
    """Raise ValueError in one line when `scaling` is not plain RoPE or a complete llama3 rule."""
    kind = rope_type(scaling)
    if kind == "default":
        return
    if kind == "yarn":
        missing = [key for key in YARN_KEYS if scaling.get(key) is None]
        if missing:
            raise ValueError(f"rope_scaling 'yarn' lacks {missing}; give all of {list(YARN_KEYS)}")
        return
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (megalite builds plain RoPE, 'llama3' and "
                         f"'yarn'); use a model without it")
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"rope_scaling 'llama3' lacks {missing}; give all of {list(LLAMA3_KEYS)}")
    if not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
        raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {scaling}")



def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """What the cos/sin tables are multiplied by under YaRN: the given attention_factor, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def softmax_scale_factor(scaling: dict | None) -> float:
    """DeepSeek MLA's softmax scale correction: yarn_mscale(factor, mscale_all_dim)^2 (1 without YaRN)."""
    if rope_type(scaling) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
