"""Sampling from a trained model: a KV cache over GPTModel's own layers (cache.py), the choice of the
next token (sampling.py) and the loop over batched prompts (generate.py); tools/generate.py is its
command line. Above model/: nothing below imports it."""
from megalite.generation.cache import KVCache, forward_step
from megalite.generation.generate import generate
from megalite.generation.sampling import SamplingParams, next_tokens

__all__ = ["KVCache", "forward_step", "generate", "SamplingParams", "next_tokens"]
