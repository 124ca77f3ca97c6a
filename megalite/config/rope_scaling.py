"""RoPE frequency scaling for long contexts (Llama 3.1's "llama3" rule): its torch-free checks.

`GPTConfig.rope_scaling` holds HF's dict (`rope_type` plus its numbers); plain RoPE is None.
Only "llama3" is built: any other type is refused by name (check_rope_scaling), never approximated.

The llama3 rule (Meta's Llama 3.1 release) keeps the high frequencies, divides the low ones by
`factor`, and blends linearly in between, judged by each frequency's wavelength 2*pi/f against
the original context length L: wavelength < L/high_freq_factor -> f; wavelength > L/low_freq_factor
-> f/factor; else (1 - t) * f/factor + t * f with t = (L/wavelength - low) / (high - low).
The rule itself (torch) is model/rope.py's scale_frequencies.
"""
from __future__ import annotations

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict) -> None:
    """Raise ValueError in one line when `scaling` is not plain RoPE or a complete llama3 rule."""
    kind = rope_type(scaling)
    if kind == "default":
        return
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (megalite builds plain RoPE and 'llama3'); "
                         f"use a model without it")
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"rope_scaling 'llama3' lacks {missing}; give all of {list(LLAMA3_KEYS)}")
    if not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
        raise ValueError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {scaling}")

